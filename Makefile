# The README's two commands. Each installs what it needs (launch/install.sh is quick
# when everything is already there), then does its job.
VENV ?= .venv
NP ?= 2
# make test's pytest-xdist workers.
TEST_WORKERS ?= 2
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: install install-test demo test test-fast test-kill bench gpu-kit clean

install:
	VENV=$(VENV) bash launch/install.sh

install-test:
	VENV=$(VENV) bash launch/install.sh --extras test,bench
	bash launch/install-cluster-tools.sh

## make demo: train the built-in digits model on 2 processes with horovodrun.
demo: install
	horovodrun -np $(NP) hvdtrain fit

## make test: the whole suite, multi-process tests included (CPU only), on 2 pytest-xdist workers:
## a test file runs whole on one worker (its shared runs made once), the longest files first
## (tests/file_order.py); many tests wait on timeouts, signals and launchers, which leaves the cores
## idle a third of the time on one worker. Tests marked serial time their steps and run alone afterwards.
test: install-test
	python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not serial" -ra --durations=40; shared=$$?; \
	python -m pytest -m serial -ra; alone=$$?; exit $$((shared || alone))

## make test-fast: the in-process tests only (no launchers, no Slurm, no image builds).
test-fast: install-test
	python -m pytest -ra -m "not multiprocess and not system"

## make test-kill: one rank killed at 20 random moments (make test runs 3), each resumed exactly.
test-kill: install-test
	HVDTRAIN_KILL_MOMENTS=20 python -m pytest -ra tests/test_preemption.py -k random_moments

## make bench: hvdtrain fit against a hand-written Horovod loop, torchrun DDP and one process;
## then the cost of the stop check and of checkpoints inside an epoch; then the input pipeline of
## each kind of data source, and of a generated folder of JPEGs (decoding, augmentation on the device);
## then a 50 M-parameter model with AdamW, its optimizer state sharded against not (memory, samples/s);
## then two hosts on a 1 Gbit/s link (as root): fp32, fp16, bf16 and PowerSGD against the ceiling.
bench: install-test
	python benchmarks/run.py
	python benchmarks/stop_check.py
	python benchmarks/sharded_optimizer.py
	python benchmarks/two_hosts.py
	python benchmarks/data_sources.py
	python benchmarks/image_folder.py

## make gpu-kit: fill .gpu-kit/ (ignored by git) with what a GPU machine without a network lacks:
## Horovod's source, a few wheels and hvdtrain's own; there launch/gpu-check.sh OUT_DIR uses it.
gpu-kit:
	bash launch/gpu-kit.sh

clean:
	rm -rf runs .pytest_cache
