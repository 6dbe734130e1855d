"""Tiny HF transformers models from a config, random weights, for tests (nothing downloaded).

Each test file passes the sizes it needs; ``seed`` makes the weights reproducible (None: the
caller seeds, or does not care).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def tiny_llama(seed: int | None = 0, **config: Any) -> torch.nn.Module:
    """A ``LlamaForCausalLM`` with eager attention; ``config`` overrides the sizes below."""
    import transformers

    sizes: dict[str, Any] = dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager",
    )
    if seed is not None:
        torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**sizes, **config}))


def tiny_gpt2(seed: int | None = 0, **config: Any) -> torch.nn.Module:
    """A ``GPT2LMHeadModel``; ``config`` overrides the sizes below."""
    import transformers

    sizes: dict[str, Any] = dict(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    if seed is not None:
        torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**sizes, **config}))


def train_steps(model: torch.nn.Module, session: Any = None, steps: int = 2, autocast: bool = False,
                before_step: Callable[[int], None] | None = None) -> list[torch.Tensor]:
    """AdamW steps on random token batches (seeded: the same batches every call), ending each
    with ``session.step()`` when given; the detached losses. ``autocast``: the forward under bf16
    autocast; ``before_step(k)`` runs before step k's batch (a fault switched on between steps)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    losses = []
    for step in range(steps):
        if before_step is not None:
            before_step(step)
        ids = torch.randint(0, vocab, (2, 16), generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        if session is not None:
            session.step()
    return losses


def assert_trained_alike(plain_model: torch.nn.Module, plain: list[torch.Tensor], model: torch.nn.Module,
                         traced: list[torch.Tensor], rng_before: torch.Tensor) -> None:
    """The probed training equals the plain one: the same losses, the same weights after it,
    and torch's RNG where the plain run left it (``rng_before``: read right after that run)."""
    assert all(torch.equal(a, b) for a, b in zip(plain, traced, strict=True))
    assert torch.equal(rng_before, torch.get_rng_state())
    for (name, p), q in zip(plain_model.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q), name


def tiny_qwen2(seed: int | None = 0, **config: Any) -> torch.nn.Module:
    """A ``Qwen2ForCausalLM`` with eager attention; ``config`` overrides the sizes below."""
    import transformers

    sizes: dict[str, Any] = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager",
    )
    if seed is not None:
        torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{**sizes, **config}))


def zoo_case(task: str, name: str, pair: str, root: Any, fault: str | None = None) -> Any:
    """The zoo's case of architecture ``name`` of ``task`` (built from its shrunk default config,
    as ``benchmarks.zoo`` builds it), run end to end under ``root``: its ``Outcome``."""
    from benchmarks.zoo import Case, run_case
    from benchmarks.zoo_architectures import Built, architectures, build

    arch = next(a for a in architectures(task) if a.name == name)
    built = build(arch)
    assert isinstance(built, Built), built
    return run_case(Case(arch, pair, fault), built, root, {})
