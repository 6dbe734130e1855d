"""The report's workloads: plain torch models, random weights, synthetic data.

Each :class:`Workload` builds a :class:`Trainer` (model, AdamW, a fixed data
stream) on a device in a dtype mode, and knows what one step processes (tokens
or samples) and how many FLOPs it costs, for throughput and MFU:

- ``llama-7b-1layer``: the LLaMA2-7B-wide decoder layer of ``benchmarks.models``;
  ``llama-small``: the same architecture scaled down for a CPU;
- ``gpt-small``: a GPT-2-style decoder (learned positions, LayerNorm, GELU MLP);
- ``resnet50``: ResNet-50's bottleneck stack (3-4-6-3 blocks, 64 to 2048 channels);
- ``yolo-head``: a YOLOv5-style stack (Conv-BN-SiLU, C3 blocks, three detection
  scales) with a regression loss on synthetic targets;
- ``hf-llama-small``: an HF transformers ``LlamaForCausalLM`` from a config (hidden 256,
  4 layers, batch 4 x 128; about 1,300 aten ops a step: launch- and host-bound);
  ``hf-llama7b-width``: the same at LLaMA2-7B width, 2 layers, batch 1 x 2048 (for a
  GPU, in bf16). Both train with AdamW's default ``foreach`` (multi-tensor updates on
  GPUs), as HF training does.

Decoder FLOPs follow the PaLM paper: ``6 * params * tokens`` plus attention,
``12 * layers * seq * hidden`` per token (forward and backward, causal mask not
discounted). CNN FLOPs are counted by ``torch.utils.flop_counter`` on one step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

DTYPE_MODES = ("fp32", "bf16", "fp16", "autocast")


# -- models ----------------------------------------------------------------------------


class GPTBlock(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc, self.out = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, h))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.layers = nn.ModuleList(GPTBlock(hidden, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln(x))


def _conv(cin: int, cout: int, k: int = 1, stride: int = 1, act: type[nn.Module] = nn.ReLU) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout), act())


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.body = nn.Sequential(
            _conv(cin, width),
            _conv(width, width, 3, stride),
            nn.Conv2d(width, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.shortcut = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


class ResNet50(nn.Module):
    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(_conv(3, 64, 7, 2), nn.MaxPool2d(3, 2, 1))
        stages, cin = [], 64
        for i, (blocks, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512), strict=True)):
            for j in range(blocks):
                stages.append(Bottleneck(cin, width, 2 if j == 0 and i > 0 else 1))
                cin = 4 * width
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.stages(self.stem(x)).mean((2, 3)))


class C3(nn.Module):
    """YOLOv5's CSP block: two branches, n bottlenecks on one, concatenated."""

    def __init__(self, cin: int, cout: int, n: int) -> None:
        super().__init__()
        mid = cout // 2
        self.a, self.b = _conv(cin, mid, act=nn.SiLU), _conv(cin, mid, act=nn.SiLU)
        self.m = nn.Sequential(
            *(nn.Sequential(_conv(mid, mid, act=nn.SiLU), _conv(mid, mid, 3, act=nn.SiLU)) for _ in range(n))
        )
        self.out = _conv(2 * mid, cout, act=nn.SiLU)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.cat([self.m(self.a(x)), self.b(x)], 1))


class YOLOHead(nn.Module):
    """A YOLOv5s-sized backbone and detection head: three scales of 3 anchors x (5 + classes)."""

    def __init__(self, classes: int = 80) -> None:
        super().__init__()
        silu = nn.SiLU
        self.stem = nn.Sequential(_conv(3, 32, 6, 2, silu), _conv(32, 64, 3, 2, silu), C3(64, 64, 1))
        self.p3 = nn.Sequential(_conv(64, 128, 3, 2, silu), C3(128, 128, 2))
        self.p4 = nn.Sequential(_conv(128, 256, 3, 2, silu), C3(256, 256, 3))
        self.p5 = nn.Sequential(_conv(256, 512, 3, 2, silu), C3(512, 512, 1))
        self.detect = nn.ModuleList(nn.Conv2d(c, 3 * (5 + classes), 1) for c in (128, 256, 512))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        p3 = self.p3(self.stem(x))
        p4 = self.p4(p3)
        p5 = self.p5(p4)
        return [conv(p) for conv, p in zip(self.detect, (p3, p4, p5), strict=True)]


# -- trainers ----------------------------------------------------------------------------


def _cast(dtype_mode: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "autocast": torch.float32}[
        dtype_mode
    ]


def _autocast(device: str, dtype_mode: str) -> Any:
    if dtype_mode != "autocast":
        return nullcontext()
    device_type = torch.device(device).type
    return torch.autocast(device_type, dtype=torch.bfloat16 if device_type == "cpu" else torch.float16)


class Trainer:
    """One training step of a model on fixed synthetic batches (AdamW, foreach off)."""

    def __init__(
        self,
        model: nn.Module,
        batch: Callable[[torch.Generator], Any],
        loss: Callable[[nn.Module, Any], torch.Tensor],
        device: str,
        dtype_mode: str,
        foreach: bool | None = False,
    ) -> None:
        self.device, self.dtype_mode = device, dtype_mode
        self.model = model.to(device=device, dtype=_cast(dtype_mode))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, foreach=foreach)
        self._batch, self._loss = batch, loss
        self.data = torch.Generator().manual_seed(1)

    def step(self) -> torch.Tensor:
        inputs = self._batch(self.data)
        with _autocast(self.device, self.dtype_mode):
            loss = self._loss(self.model, inputs)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def synchronize(self) -> None:
        if torch.device(self.device).type != "cpu":
            torch.accelerator.synchronize()


@dataclass(frozen=True)
class Workload:
    name: str
    family: str
    """``llama``, ``gpt``, ``resnet`` or ``yolo`` (seed reports are per family)."""
    build: Callable[[str, str], Trainer]
    units: int
    """Tokens (decoders) or samples (CNNs) per step."""
    unit: str
    lm_shape: tuple[int, int, int] | None = None
    """(layers, seq, hidden) of a decoder, for the attention FLOPs."""

    def trainer(self, device: str = "cpu", dtype_mode: str = "fp32") -> Trainer:
        torch.manual_seed(0)
        return self.build(device, dtype_mode)

    def flops_per_step(self, trainer: Trainer) -> float:
        """Training FLOPs of one step (see the module docstring)."""
        if self.lm_shape is not None:
            params = sum(p.numel() for p in trainer.model.parameters())
            layers, seq, hidden = self.lm_shape
            return self.units * (6 * params + 12 * layers * seq * hidden)
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            inputs = trainer._batch(torch.Generator().manual_seed(99))
            with _autocast(trainer.device, trainer.dtype_mode):
                trainer._loss(trainer.model, inputs).backward()
        trainer.optimizer.zero_grad(set_to_none=True)
        return float(counter.get_total_flops())


def _token_batch(vocab: int, batch: int, seq: int, device: str) -> Callable[[torch.Generator], torch.Tensor]:
    return lambda g: torch.randint(0, vocab, (batch, seq + 1), generator=g).to(device)


def _lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def _llama(hidden: int, inter: int, layers: int, heads: int, vocab: int, batch: int, seq: int) -> Workload:
    from probe.demo.model import LlamaConfig, TinyLlama

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        max_seq_len=seq,
    )

    def build(device: str, dtype_mode: str) -> Trainer:
        model = TinyLlama(config)
        return Trainer(
            model, _token_batch(vocab, batch, seq, device), lambda m, t: m.loss(t), device, dtype_mode
        )

    name = "llama-7b-1layer" if hidden == 4096 else "llama-small"
    return Workload(name, "llama", build, batch * seq, "tokens", (layers, seq, hidden))


def _gpt(hidden: int, layers: int, heads: int, vocab: int, batch: int, seq: int) -> Workload:
    def build(device: str, dtype_mode: str) -> Trainer:
        return Trainer(
            GPT(vocab, hidden, layers, heads, seq),
            _token_batch(vocab, batch, seq, device),
            _lm_loss,
            device,
            dtype_mode,
        )

    return Workload("gpt-small", "gpt", build, batch * seq, "tokens", (layers, seq, hidden))


def _images(batch: int, size: int, device: str) -> Callable[[torch.Generator], torch.Tensor]:
    return lambda g: torch.randn(batch, 3, size, size, generator=g).to(device)


def _resnet(batch: int, size: int) -> Workload:
    def loss(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
        labels = torch.arange(images.shape[0], device=images.device) % 1000
        return F.cross_entropy(model(images.to(next(model.parameters()).dtype)).float(), labels)

    def build(device: str, dtype_mode: str) -> Trainer:
        return Trainer(ResNet50(), _images(batch, size, device), loss, device, dtype_mode)

    return Workload("resnet50", "resnet", build, batch, "images")


def _yolo(batch: int, size: int) -> Workload:
    def loss(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
        outputs = model(images.to(next(model.parameters()).dtype))
        # Synthetic targets: a fixed pattern per scale; the loss only has to reach every head.
        return sum(F.mse_loss(o.float().sigmoid(), torch.full_like(o.float(), 0.25)) for o in outputs)

    def build(device: str, dtype_mode: str) -> Trainer:
        return Trainer(YOLOHead(), _images(batch, size, device), loss, device, dtype_mode)

    return Workload("yolo-head", "yolo", build, batch, "images")


def _import_transformers() -> Any:
    """``transformers``; in a peer's venv without it (msprobe's), the copy of this
    repository's ``.venv`` (same Python), appended after the venv's own packages."""
    try:
        import transformers
    except ImportError:
        import sys
        from pathlib import Path

        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
        site = Path(__file__).resolve().parent.parent / ".venv" / "lib" / version / "site-packages"
        if not site.is_dir():
            raise
        sys.path.append(str(site))
        import transformers
    return transformers


def _hf_llama(name: str, hidden: int, inter: int, layers: int, heads: int, vocab: int, batch: int,
              seq: int, attention: str) -> Workload:
    """An HF ``LlamaForCausalLM`` with random weights from a config (nothing downloaded);
    ``attention``: its ``attn_implementation`` ("eager", "sdpa")."""

    def build(device: str, dtype_mode: str) -> Trainer:
        transformers = _import_transformers()
        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=seq,
            attn_implementation=attention,
        )
        model = transformers.LlamaForCausalLM(config)

        def loss(m: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
            return m(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss

        return Trainer(model, _token_batch(vocab, batch, seq, device), loss, device, dtype_mode, foreach=None)

    return Workload(name, "llama", build, batch * seq, "tokens", (layers, seq, hidden))


# Issue 22's CPU workload: eager attention, as the issue measured it (HF's default would be SDPA;
# figures before 2026-11-27 were taken with SDPA). The 7B-wide GPU step keeps SDPA: eager
# attention at sequence 2048 is not what such a model runs.
HF_LLAMA_SMALL = ("hf-llama-small", 256, 688, 4, 4, 1024, 4, 128, "eager")
HF_LLAMA7B_WIDTH = ("hf-llama7b-width", 4096, 11008, 2, 32, 32000, 1, 2048, "sdpa")


def workloads(quick: bool = False) -> dict[str, Workload]:
    """Name -> workload; ``quick``: small shapes for a CI smoke run."""
    if quick:
        found = [_llama(64, 172, 2, 4, 256, 2, 32), _gpt(64, 2, 4, 256, 2, 32), _resnet(1, 64), _yolo(1, 64)]
    else:
        found = [
            _llama(4096, 11008, 1, 32, 1024, 1, 64),
            _llama(1024, 2752, 2, 16, 4096, 4, 256),
            _gpt(768, 2, 12, 4096, 4, 256),
            _resnet(2, 160),
            _yolo(2, 320),
            _hf_llama(*HF_LLAMA_SMALL),
        ]
        if torch.accelerator.is_available():  # a 7B-wide seq-2048 step is minutes on a CPU
            found.append(_hf_llama(*HF_LLAMA7B_WIDTH))
    return {w.name: w for w in found}


def peak_flops(device: str, dtype_mode: str) -> tuple[float, str]:
    """The device's peak FLOP/s for the dtype, and where the figure comes from.

    GPUs in the table: the vendor's dense figure. Anything else (the CPU, an NPU,
    another GPU): measured here, the best of five large matmuls (a practical
    peak, not a datasheet one).
    """
    kind = torch.device(device).type
    if kind == "cuda":
        name = torch.cuda.get_device_name(torch.device(device))
        for key, table in _GPU_PEAKS.items():
            if key in name:
                return table[dtype_mode], f"{name} datasheet (dense)"
    # autocast's matmuls run in bf16 on the CPU and fp16 on GPUs; the peak is that dtype's.
    low = torch.bfloat16 if kind == "cpu" else torch.float16
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "autocast": low}
    dtype = dtypes[dtype_mode]
    n = 1024 if kind == "cpu" else 8192
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    best = math.inf
    for _ in range(5):
        if kind != "cpu":
            torch.accelerator.synchronize()
        start = time.perf_counter()
        a @ b
        if kind != "cpu":
            torch.accelerator.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best, f"measured: best of 5 {n}x{n} {dtype_mode} matmuls"


# Dense tensor-core peaks (FLOP/s) by dtype mode; fp32 is the non-tensor-core rate.
_GPU_PEAKS = {
    "H200": {"fp32": 67e12, "bf16": 989e12, "fp16": 989e12, "autocast": 989e12},
    "H100": {"fp32": 67e12, "bf16": 989e12, "fp16": 989e12, "autocast": 989e12},
    "A100": {"fp32": 19.5e12, "bf16": 312e12, "fp16": 312e12, "autocast": 312e12},
}
