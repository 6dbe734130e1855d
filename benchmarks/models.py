"""The models the overhead benchmark trains.

``demo`` and ``llama7b-shaped`` are ``probe.demo.model.TinyLlama``: the demo's default
size, and one decoder layer at LLaMA2-7B width with a small vocabulary, sized so that a
training step takes seconds on a CPU. ``hf-llama-small`` and ``hf-llama7b-width`` are
HF transformers Llamas of ``benchmarks.workloads`` (random weights from a config).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from benchmarks.workloads import HF_LLAMA7B_WIDTH, HF_LLAMA_SMALL, Trainer, _hf_llama
from probe.demo.model import LlamaConfig, TinyLlama
from probe.demo.train import DemoTraining


@dataclass(frozen=True)
class ModelSpec:
    """A model shape and the batch it is trained on."""

    name: str
    config: LlamaConfig
    batch: int
    seq: int
    foreach: bool | None = None
    """AdamW's ``foreach``; ``None`` is torch's default choice."""

    def with_seq(self, seq: int) -> ModelSpec:
        """The same model trained on sequences of ``seq`` tokens."""
        config = replace(self.config, max_seq_len=max(self.config.max_seq_len, seq))
        return replace(self, config=config, seq=seq)

    def trainer(self, seed: int = 0, device: str = "cpu") -> DemoTraining:
        """A fresh model, optimizer and data stream on ``device``, all built from ``seed``."""
        return DemoTraining(self.config, self.batch, self.seq, seed, foreach=self.foreach, device=device)

    def num_params(self) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in TinyLlama(self.config).parameters())

    def describe(self) -> str:
        c = self.config
        return (
            f"hidden {c.hidden_size}, heads {c.num_heads}, intermediate {c.intermediate_size}, "
            f"layers {c.num_layers}, vocab {c.vocab_size}; batch {self.batch}, seq {self.seq}; "
            f"AdamW foreach={self.foreach}"
        )


DEMO = ModelSpec("demo", LlamaConfig(), batch=4, seq=32)

LLAMA7B_SEQ = 64
LLAMA7B_SHAPED = ModelSpec(
    "llama7b-shaped",
    LlamaConfig(
        vocab_size=1024,
        hidden_size=4096,
        intermediate_size=11008,
        num_layers=1,
        num_heads=32,
        max_seq_len=LLAMA7B_SEQ,
    ),
    batch=1,
    seq=LLAMA7B_SEQ,
    foreach=False,
)

@dataclass(frozen=True)
class WorkloadSpec:
    """A workload of ``benchmarks.workloads`` (an HF model) in the overhead benchmark's terms."""

    name: str
    shape: tuple[str, int, int, int, int, int, int, int]
    """The arguments of ``workloads._hf_llama``: name, hidden, intermediate, layers, heads,
    vocab, batch, seq."""
    dtype_mode: str = "fp32"

    def with_seq(self, seq: int) -> WorkloadSpec:
        return replace(self, shape=(*self.shape[:7], seq, *self.shape[8:]))  # type: ignore[arg-type]

    def with_dtype(self, dtype_mode: str) -> WorkloadSpec:
        return replace(self, dtype_mode=dtype_mode)

    def trainer(self, seed: int = 0, device: str = "cpu") -> Trainer:
        torch.manual_seed(seed)
        return _hf_llama(*self.shape).build(device, self.dtype_mode)

    def num_params(self) -> int:
        _, hidden, inter, layers, _, vocab, _, _, _ = self.shape
        return 2 * vocab * hidden + layers * (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden) + hidden

    def describe(self) -> str:
        _, hidden, inter, layers, heads, vocab, batch, seq, attention = self.shape
        return (
            f"HF LlamaForCausalLM hidden {hidden}, heads {heads}, intermediate {inter}, layers {layers}, "
            f"vocab {vocab}, {attention} attention; batch {batch}, seq {seq}; {self.dtype_mode}; "
            "AdamW foreach=default"
        )


HF_LLAMA_SMALL_SPEC = WorkloadSpec("hf-llama-small", HF_LLAMA_SMALL)
HF_LLAMA7B_WIDTH_SPEC = WorkloadSpec("hf-llama7b-width", HF_LLAMA7B_WIDTH, dtype_mode="bf16")

MODELS: dict[str, ModelSpec | WorkloadSpec] = {
    spec.name: spec for spec in (DEMO, LLAMA7B_SHAPED, HF_LLAMA_SMALL_SPEC, HF_LLAMA7B_WIDTH_SPEC)
}
