"""A small causal transformer language model, trained on Python's own standard library
sources (they ship with every Python, so nothing is downloaded).

    PYTHONPATH=examples horovodrun -np 2 hvdtrain fit --task language-model \
        --data tiny_lm:data --model tiny_lm:model --set data.collate=pad \
        --optimizer adamw --lr 0.002 --batch-size 32 --epochs 4

Bytes are the tokens (a vocabulary of 256). A sample is one paragraph of source (the
lines between two blank lines), at most 128 bytes, so samples differ in length: the
built-in `pad` collate pads each batch to its longest sample, `input_ids` with 0 and
`labels` with -100, which no loss or metric scores. Samples are dicts and the model
takes `labels`, so, like a Hugging Face model, it computes its own loss; the task
still reads its logits for token accuracy and perplexity.
"""

import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

SOURCES = ("argparse.py", "difflib.py", "textwrap.py", "inspect.py", "dataclasses.py", "typing.py")
MAX_BYTES = 128
VOCABULARY = 256


class Paragraphs(Dataset):
    """Paragraphs of standard library source as byte sequences, each as a dict."""

    def __init__(self, paragraphs: list[bytes]):
        self.paragraphs = paragraphs

    def __len__(self):
        return len(self.paragraphs)

    def __getitem__(self, index):
        ids = torch.tensor(list(self.paragraphs[index]), dtype=torch.long)
        return {"input_ids": ids, "labels": ids.clone()}


def data(validation_share: float = 0.1):
    """(train, val): every tenth paragraph is held out."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paragraphs = []
    for name in SOURCES:
        text = (stdlib / name).read_bytes()
        paragraphs += [p.strip(b"\n")[:MAX_BYTES] for p in text.split(b"\n\n") if len(p.strip()) >= 16]
    every = round(1 / validation_share)
    val = [p for i, p in enumerate(paragraphs) if i % every == 0]
    train = [p for i, p in enumerate(paragraphs) if i % every != 0]
    return Paragraphs(train), Paragraphs(val)


class TinyCausalLM(nn.Module):
    def __init__(self, width: int = 96, layers: int = 2, heads: int = 4):
        super().__init__()
        self.tokens = nn.Embedding(VOCABULARY, width)
        self.positions = nn.Embedding(MAX_BYTES, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCABULARY)

    def forward(self, input_ids, labels=None):
        length = input_ids.shape[1]
        hidden = self.tokens(input_ids) + self.positions(torch.arange(length, device=input_ids.device))
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=input_ids.device)
        logits = self.head(self.norm(self.blocks(hidden, mask=mask, is_causal=True)))
        if labels is None:
            return logits
        # Position t predicts byte t + 1; padding (-100) is not scored.
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCABULARY), labels[:, 1:].reshape(-1), ignore_index=-100)
        return {"loss": loss, "logits": logits}


def model():
    return TinyCausalLM()
