import pytest
import yaml

from hvdtrain.config import Config, describe, load_config, parse_assignment
from hvdtrain.config.loading import read_yaml, write_yaml
from hvdtrain.errors import UserError


def test_defaults_validate():
    config = Config()
    assert config.data.name == "digits" and config.train.epochs >= 1


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  batch_size: 32\ntrain:\n  epochs: 3\n")
    config = load_config(path, {"train.epochs": 5, "optim.lr": "0.2"})
    assert config.data.batch_size == 32
    assert config.train.epochs == 5
    assert config.optim.lr == pytest.approx(0.2)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"data.btch_size": 3}, "config key 'data.btch_size' does not exist: did you mean 'data.batch_size'?"),
        ({"trian.epochs": 3}, "config key 'trian' does not exist: did you mean 'train'?"),
        # a key in another section, or under another tool's name, is pointed at its own
        ({"train.batch_size": 3}, "config key 'train.batch_size' does not exist: did you mean 'data.batch_size'?"),
        ({"optim.learning_rate": 0.1}, "config key 'optim.learning_rate' does not exist: did you mean 'optim.lr'?"),
        ({"train.max_epochs": 3}, "config key 'train.max_epochs' does not exist: did you mean 'train.epochs'?"),
        ({"train.workers": 2}, "config key 'train.workers' does not exist: did you mean 'data.num_workers'?"),
        ({"train.name": "x"}, "config key 'train.name' does not exist: did you mean 'data.name', 'model.name', "
                              "'task.name' or 'optim.name'?"),
        ({"data.batch_size": "many"}, "config key 'data.batch_size' must be an integer, got 'many'"),
        ({"data.batch_size": 0}, "config key 'data.batch_size' must be at least 1, got 0"),
        ({"optim.name": "lamb"}, "config key 'optim.name' must be sgd, adamw or package.module:function, got 'lamb'"),
        ({"optim.scale_lr": "maybe"}, "config key 'optim.scale_lr' must be true or false"),
        ({"optim.lr": -1}, "config key 'optim.lr' must be positive"),
        ({"run.resume": True, "run.overwrite": True}, "exclude each other"),
        ({"data.val_fraction": 0}, "config key 'data.val_fraction' must be more than 0 and less than 1 (fit validates"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(UserError, match=message.replace("?", r"\?").replace("(", r"\(")):
        Config.from_dict({}, overrides)


def test_a_section_key_at_the_top_of_a_file_is_pointed_at_its_section():
    with pytest.raises(UserError, match=r"^config key 'epochs' does not exist: did you mean 'train.epochs'\?$"):
        Config.from_dict({"epochs": 3})


def test_hydra_s_keys_say_how_hvdtrain_names_the_same():
    with pytest.raises(UserError, match=r"^config key 'model._target_' does not exist: Hydra's name for a class to "
                                        r"build; hvdtrain's is model.name, a package.module:function \(or :Class\) given "
                                        r"its arguments from model.args$"):
        Config.from_dict({"model": {"_target_": "mymodule.Net", "hidden": 64}})
    with pytest.raises(UserError, match=r"^config key 'train._target_' does not exist: Hydra's name for a class to "
                                        r"build; in hvdtrain the data, model, task and optim sections each name theirs"):
        Config.from_dict({"train": {"_target_": "lightning.Trainer"}})  # train has no name nor args
    with pytest.raises(UserError, match=r"^config key 'defaults' does not exist: Hydra's list of other config files; "
                                        r"hvdtrain reads one file \(--config\)"):
        Config.from_dict({"defaults": [{"model": "mlp"}]})


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_config(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML at line"):
        load_config(bad)
    # A section given twice lost the first's keys silently (PyYAML keeps the second); `<<:` merges still override.
    twice = tmp_path / "twice.yaml"
    twice.write_text("train:\n  epochs: 3\ndata:\n  batch_size: 32\ntrain:\n  seed: 1\n")
    with pytest.raises(UserError, match=r"^config file '.*twice.yaml' has train: twice in one mapping \(lines 1 and 5\), "
                                        r"and YAML would keep only the second: merge them into one$"):
        load_config(twice)
    merged = tmp_path / "merged.yaml"
    merged.write_text("train:\n  <<: {epochs: 3, seed: 5}\n  epochs: 4\n")
    assert (load_config(merged).train.epochs, load_config(merged).train.seed) == (4, 5)
    # An anchored mapping with a merge of its own, merged again elsewhere; an int key beside a text one.
    from hvdtrain.config.loading import read_yaml

    assert read_yaml("model:\n  args:\n    block: &b\n      <<: {width: 8}\n      width: 16\n    1: one\n"
                     "    '1': also\ndata:\n  args:\n    <<: *b\n") == {
        "model": {"args": {"block": {"width": 16}, 1: "one", "1": "also"}}, "data": {"args": {"width": 16}}}
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(UserError, match="must hold a mapping"):
        load_config(listing)


def test_a_data_path_found_only_next_to_the_config_file_says_so(tmp_path, monkeypatch):
    """Relative paths are the working directory's; a job started from elsewhere read `data file
    'data/x.npz' does not exist`, with no word of where it was looked for."""
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "data" / "x.npz").write_bytes(b"")
    (project / "run.yaml").write_text("data:\n  name: data/x.npz\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as refused:
        load_config("project/run.yaml")
    assert str(refused.value) == (
        f"data.name 'data/x.npz' in project/run.yaml is not in the working directory ({tmp_path}), but is next to the "
        f"config file: paths are the working directory's; run from {project}, or write it as {project}/data/x.npz")
    assert load_config("project/run.yaml", {"data.name": "elsewhere.npz"}).data.name == "elsewhere.npz"
    monkeypatch.chdir(project)
    assert load_config("run.yaml").data.name == "data/x.npz"


def test_floats_written_without_a_dot_are_numbers_in_a_factory_s_own_arguments(tmp_path):
    """YAML 1.1 (PyYAML's) reads `1e-8` as a string: `optim.args.eps: 1e-8` reached Adam as '1e-8'
    ("'<=' not supported between 'float' and 'str'"). Read as YAML 1.2 and Python do, from a file and --set."""
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  name: torch.optim:Adam\n  args:\n    eps: 1e-8\n    betas: [0.9, 9.99E-1]\n")
    config = load_config(path, dict([parse_assignment("optim.args.weight_decay=5e-4")]))
    assert config.optim.args == {"eps": 1e-8, "betas": [0.9, 0.999], "weight_decay": 5e-4}
    assert parse_assignment("data.args.name=1e") == ("data.args.name", "1e")  # not a number: a string still
    assert parse_assignment("data.args.commit=7e03841") == ("data.args.commit", "7e03841")  # a hash, not 7e3841
    assert Config.from_dict({}, {"run.checkpoint_every_steps": read_yaml("1e3")}).run.checkpoint_every_steps == 1000
    # Text that would read as a float is quoted where hvdtrain writes YAML (config.yaml): it reads back as text.
    saved = {"data": {"name": "digits", "args": {"tag": "1e3"}}}
    assert read_yaml(write_yaml(saved)) == saved


def test_set_assignments_parse_as_yaml():
    assert parse_assignment("data.batch_size=32") == ("data.batch_size", 32)
    assert parse_assignment("optim.clip_grad_norm=null") == ("optim.clip_grad_norm", None)
    with pytest.raises(UserError, match="section.key=value"):
        parse_assignment("batch_size")
    with pytest.raises(UserError, match=r"expects section.key=value: did you mean --set data.batch_size=64\?"):
        parse_assignment("batch_size=64")
    with pytest.raises(UserError, match=r"did you mean --set optim.lr=0.1\?"):
        parse_assignment("learning_rate=0.1")


def test_describe_is_loadable_yaml_with_every_key_documented():
    text = describe()
    assert yaml.safe_load(text) == Config().to_dict()
    comments = [line for line in text.splitlines() if line.strip().startswith("#")]
    keys = [line for line in text.splitlines() if line.startswith("  ") and not line.strip().startswith("#")]
    assert len(comments) >= len(keys)  # a docstring per field


def test_saved_config_round_trips():
    config = Config.from_dict({}, {"data.name": "random", "optim.clip_grad_norm": 1.5})
    assert Config.from_dict(yaml.safe_load(yaml.safe_dump(config.to_dict()))) == config


def test_resume_or_overwrite_on_the_command_line_wins_over_the_file_s_other(tmp_path):
    """A config file saying `resume: true` (an older run's config.yaml, a requeue recipe) with --overwrite:
    the command line's way with the directory, not a clash of the two."""
    from hvdtrain.config import settings_config

    path = tmp_path / "run.yaml"
    path.write_text("run:\n  resume: true\n")
    config = settings_config(path, {}, {"overwrite": True})
    assert (config.run.resume, config.run.overwrite) == (False, True)
    path.write_text("run:\n  overwrite: true\n")
    config = settings_config(path, {}, {"resume": True})
    assert (config.run.resume, config.run.overwrite) == (True, False)
    with pytest.raises(UserError, match="exclude each other"):
        settings_config(None, {}, {"resume": True, "overwrite": True})
