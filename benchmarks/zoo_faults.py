"""The zoo's planted faults: each kind is planted at a randomly chosen eligible site of any model.

A site is eligible when the fault, planted there under run B's precision policy, changes the
loss of the first batch (a dry forward on a throwaway copy of the model): a fault that cannot
change the training (a module whose output the loss never reads, a norm whose eps is below its
input's rounding) is not a fault the comparison could be asked to find. The kinds:

- ``scale-output``: a module's output multiplied by (1 + delta), from step k on;
- ``cast-matmul``, ``cast-norm``, ``cast-softmax``: an explicit cast to bf16 of the inputs of
  the matmuls called in a module, of a norm module's input (where it is not bf16 already), or
  of a softmax's input (computed in bf16), from step k on (``cast-matmul`` is not applicable
  under bf16 autocast, which runs matmuls in bf16 itself: :meth:`FaultKind.not_applicable`);
- ``bitflip-mantissa``, ``bitflip-exponent``: one bit of one weight element flipped before
  step k (k >= 1: between steps), outside the trace;
- ``eps``: a norm's eps changed;
- ``loss-bf16``: the loss (cross entropy) computed in bf16;
- ``clip``: the gradients clipped at step k (both runs call ``clip_grad_norm_`` every step,
  run A with no bound);
- ``dropout``: a dropout module's probability raised from 0 at step k;
- ``mask-shift``: an attention module's mask shifted by one key position from step k
  (``benchmarks.diagnosis``'s attention function; a site is eligible where the shift changes
  the loss against that function unshifted: a module without a mask has nothing to shift);
- ``optimizer-fp16``: AdamW's second moments (``exp_avg_sq``, every parameter's) kept in fp16
  from step k on (k >= 1): what step k-1's update left is stored in fp16, outside the trace,
  before step k's update reads it. Tiny models' squared gradients times (1 - beta2) sit near or
  below fp16's smallest normal (6.1e-5) and smallest subnormal (6e-8), so they lose bits or
  flush to zero, and the update's denominator changes with them. The expected answer is derived
  from where the change is first read: the optimizer's ops of step k (outside any module), the
  first of which reads the stored state (``_foreach_mul_``/``lerp_`` of ``exp_avg_sq``). In an
  exact pair nothing differed before; in a mixed pair the state already differs by what
  step k-1 computed in lower precision, and the fp16 storage is a change between the steps
  on top of it. A run whose states are already held lower (a bf16 model) keeps its dtype: the
  values pass through fp16 and back.
- ``overflow``: a module's output scaled, from step k on, so that its largest magnitude goes
  past its dtype's largest finite value (finite inputs, an infinite output): besides compare,
  ``Run.first_nonfinite()`` of run B must name that module and step (:mod:`benchmarks.zoo`).

delta is drawn from 0.05 to 1 in mixed-precision pairs and log-uniformly from 1e-6 to 1 in the
exact pair (fp32 against itself), where a fault of any size shows.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from benchmarks.diagnosis import Pair, Planted, _attention_fault
from benchmarks.zoo_architectures import Built, loss_of

F = torch.nn.functional
LOW = torch.bfloat16
MATMULS = {F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm,
           torch.mm, torch.Tensor.mm, torch.addmm, torch.baddbmm, torch.einsum, F.conv1d, F.conv2d}
SOFTMAXES = {F.softmax, torch.softmax, torch.Tensor.softmax}
LOSSES = {F.cross_entropy}
NORM_ATTRIBUTES = ("variance_epsilon", "eps", "epsilon", "layer_norm_eps")
TRIES = 24
"""Candidate sites tried (in a seeded random order) before a kind is ineligible for a model."""


@dataclass(frozen=True)
class FaultKind:
    """A kind of fault; ``attn`` and ``clip`` are what both runs of its cases do alike."""

    name: str
    attn: str | None = None
    """The attention implementation both runs use (a softmax exists to be cast in eager only)."""
    clip: bool = False
    """Both runs clip gradients every step (run A without a bound)."""
    between_steps: bool = False
    """Planted between steps (its step is at least 1)."""
    autocast_casts: bool = False
    """Its cast (to bf16) is one autocast makes itself (matmuls are on autocast's lower-precision
    list): under autocast to bf16 the planted computation is autocast's own, no fault. In a bf16
    model the same: its matmuls compute in bf16, and where its code widens one (a router in
    fp32), the cast undoes that widening, which makes run B compute as a bf16 model does. That
    differs from run B's own design, not from run A (fp32 throughout) by more than run B's
    precision: a comparison with a healthy bf16 run can find it, one with run A cannot."""

    def not_applicable(self, pair: Pair) -> str | None:
        """Why planting this kind in ``pair``'s run B plants nothing that policy does not do itself
        (None: it is a fault there)."""
        if self.autocast_casts and pair.autocast == LOW:
            return f"{pair.name} runs matmuls in bf16 itself: the cast is autocast's own, no fault"
        if self.autocast_casts and pair.model_dtype == LOW:
            return (f"{pair.name} computes matmuls in bf16 itself: the cast makes run B compute as its "
                    f"precision does, no fault against run A")
        return None


KINDS = {k.name: k for k in [
    FaultKind("scale-output"),
    FaultKind("cast-matmul", autocast_casts=True),
    FaultKind("cast-norm"),
    FaultKind("cast-softmax", attn="eager"),
    FaultKind("bitflip-mantissa", between_steps=True),
    FaultKind("bitflip-exponent", between_steps=True),
    FaultKind("eps"),
    FaultKind("loss-bf16"),
    FaultKind("clip", clip=True),
    FaultKind("dropout"),
    FaultKind("mask-shift"),
    FaultKind("optimizer-fp16", between_steps=True),
    FaultKind("overflow"),
]}


class _CastBefore(TorchFunctionMode):
    """Calls of ``functions`` get their floating inputs cast to bf16 (and a ``dtype`` argument
    set to bf16: computed low); the result is cast back to the first input's dtype."""

    def __init__(self, functions: set[Callable[..., Any]]) -> None:
        super().__init__()
        self.functions = functions

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func not in self.functions:
            return func(*args, **kwargs)
        first = next((a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
        low = tuple(a.to(LOW) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
        if kwargs.get("dtype") is not None:
            kwargs["dtype"] = LOW
        kwargs = {k: v.to(LOW) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                  for k, v in kwargs.items()}
        with torch.autocast("cpu", enabled=False):  # the cast is the point: autocast may not undo it
            out = func(*low, **kwargs)
        if first is not None and isinstance(out, torch.Tensor) and out.is_floating_point():
            out = out.to(first.dtype)
        return out


def _scaled(out: Any, factor: float) -> Any:
    """``out`` (a tensor, or a tuple or list starting with one) with its first tensor scaled."""
    if isinstance(out, torch.Tensor):
        return out * factor
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        scaled = [out[0] * factor, *out[1:]]
        return scaled if isinstance(out, list) else tuple(scaled)
    raise TypeError(f"cannot scale an output of type {type(out).__name__}")


def _overflowed(out: Any) -> Any:
    """``out`` (as :func:`_scaled` takes it) scaled so that its largest magnitude goes past its
    dtype's largest finite value: finite inputs, an infinite output, as an activation that grows
    unbounded overflows."""
    tensor = out if isinstance(out, torch.Tensor) else out[0]
    to_max = torch.finfo(tensor.dtype).max / tensor.detach().abs().amax().float().clamp_min(1e-30).item()
    return _scaled(_scaled(out, to_max), 2.0)  # at the largest finite value, then past it


@dataclass
class Fault:
    """A fault planted in a model: where (:class:`Planted`), what, and its switch."""

    kind: FaultKind
    site: str
    """The module (FQN) it is planted in, or a parameter for a bit flip."""
    planted: Planted
    detail: str
    """The fault's parameters in a few words ("x1.37", "bit 22 of element 5")."""
    active: bool = False
    clip_factor: float = 1.0
    _on_step: Callable[[torch.nn.Module], None] | None = field(default=None, repr=False)

    def before_step(self, model: torch.nn.Module, step: int) -> None:
        """Switches the fault on at its step (the caller pauses the trace)."""
        if step == self.planted.step:
            self.active = True
            if self._on_step is not None:
                self._on_step(model)

    def before_optimizer(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Stores the optimizer's second moments in fp16 from the planted step on (the caller
        pauses the trace): the values step k-1 left pass through fp16 before step k reads them."""
        if self.kind.name != "optimizer-fp16" or not self.active:
            return
        with torch.no_grad():
            for state in optimizer.state.values():
                moment = state.get("exp_avg_sq")
                if isinstance(moment, torch.Tensor):
                    moment.copy_(moment.to(torch.float16))

    def max_norm(self, params: list[torch.Tensor], step: int) -> float:
        """The bound run B clips gradients to at ``step`` (infinite but at the planted step)."""
        if not self.active or self.kind.name != "clip" or step != self.planted.step:
            return math.inf
        grads = [p.grad for p in params if p.grad is not None]
        return self.clip_factor * float(torch.nn.utils.get_total_norm(grads))

    @contextlib.contextmanager
    def around_loss(self) -> Iterator[None]:
        """The forward and loss of a step: the loss computed in bf16 when the fault says so."""
        if self.kind.name == "loss-bf16" and self.active:
            with _CastBefore(LOSSES):
                yield
        else:
            yield


@dataclass
class Discovery:
    """What a dry forward saw: the modules called (FQN, in call order), what each returned,
    and where (innermost module) each function of interest was called."""

    called: list[str]
    outputs: dict[str, str]
    calls: dict[str, set[str]]
    """"matmul" / "softmax" / "loss" -> the modules that called one."""


def discover(model: torch.nn.Module, forward: Callable[[torch.nn.Module], torch.Tensor]) -> Discovery:
    """Runs ``forward(model)`` once, noting modules and calls (the model is left as it was)."""
    names = {id(m): n for n, m in model.named_modules()}
    stack: list[str] = []
    called: list[str] = []
    outputs: dict[str, str] = {}
    calls: dict[str, set[str]] = {"matmul": set(), "softmax": set(), "loss": set()}

    def enter(module: torch.nn.Module, args: Any) -> None:
        name = names.get(id(module))
        if name is not None:
            stack.append(name)
            if name not in called:
                called.append(name)

    def leave(module: torch.nn.Module, args: Any, out: Any) -> None:
        name = names.get(id(module))
        if name is not None and stack and stack[-1] == name:
            stack.pop()
            first = out[0] if isinstance(out, (tuple, list)) and out else out
            outputs.setdefault(name, "tensor" if isinstance(first, torch.Tensor) and first.is_floating_point()
                               else type(out).__name__)

    def enter_other(module: torch.nn.Module, args: Any) -> None:
        # A module outside the model (a loss module made in forward) is named as the probe's
        # tracker names it: its class, under the module calling it. Calls inside it are its.
        if id(module) not in names:
            stack.append(f"{stack[-1]}.{type(module).__name__}" if stack and stack[-1]
                         else type(module).__name__)

    def leave_other(module: torch.nn.Module, args: Any, out: Any) -> None:
        if id(module) not in names and stack:
            stack.pop()

    class Calls(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                               kwargs: dict | None = None) -> Any:
            where = stack[-1] if stack else ""
            for label, functions in (("matmul", MATMULS), ("softmax", SOFTMAXES), ("loss", LOSSES)):
                if func in functions:
                    calls[label].add(where)
            return func(*args, **(kwargs or {}))

    handles = [m.register_forward_pre_hook(enter) for m in model.modules()]
    handles += [m.register_forward_hook(leave, always_call=True) for m in model.modules()]
    handles += [torch.nn.modules.module.register_module_forward_pre_hook(enter_other),
                torch.nn.modules.module.register_module_forward_hook(leave_other, always_call=True)]
    try:
        with Calls():
            forward(model)
    finally:
        for h in handles:
            h.remove()
    return Discovery(called, outputs, calls)


def _wrap_forward(module: torch.nn.Module, wrapper: Callable[..., Any]) -> None:
    """``module.forward`` replaced by ``wrapper(original, *args, **kwargs)`` (on the instance)."""
    original = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return wrapper(original, *args, **kwargs)
    module.forward = forward  # type: ignore[method-assign]


def _candidates(kind: str, model: torch.nn.Module, found: Discovery) -> list[str]:
    """The sites a kind may be planted at (before the loss check)."""
    modules = dict(model.named_modules())
    called = [n for n in found.called if n]
    if kind in ("scale-output", "overflow"):
        return [n for n in called if found.outputs.get(n) == "tensor"
                and not isinstance(modules[n], torch.nn.Dropout)]
    if kind == "cast-matmul":
        return sorted(found.calls["matmul"])
    if kind == "cast-softmax":
        return sorted(found.calls["softmax"])
    if kind == "loss-bf16":
        return sorted(found.calls["loss"])
    if kind in ("cast-norm", "eps"):
        norms = [n for n in called if "norm" in type(modules[n]).__name__.lower()]
        if kind == "eps":
            norms = [n for n in norms if any(isinstance(getattr(modules[n], a, None), float)
                                             for a in NORM_ATTRIBUTES)]
        return norms
    if kind == "dropout":
        return [n for n in called if isinstance(modules[n], torch.nn.Dropout)]
    if kind == "mask-shift":
        return [n for n in called if "attention" in type(modules[n]).__name__.lower()
                and getattr(modules[n], "config", None) is not None]
    if kind.startswith("bitflip"):
        owners: dict[int, list[str]] = {}
        for n in called:
            for pn, p in modules[n].named_parameters(recurse=False):
                owners.setdefault(id(p), []).append(f"{n}.{pn}")
        return [sites[0] for sites in owners.values() if len(sites) == 1]  # tied weights have two readers
    if kind in ("clip", "optimizer-fp16"):
        return [""]
    raise ValueError(f"unknown fault kind {kind!r}")


def _owned(model: torch.nn.Module, site: str) -> torch.nn.Module:
    """The module at ``site``, made the model's own there before a fault changes it: a shallow
    copy (the same parameters and submodules, its own attributes and hook tables) put in its
    parent's place. A module may be one instance shared by every model of the process (XLM's
    feed-forward activation is the module-level ``gelu``) or by other sites of this model: a
    fault planted in it would run at all of them, and in every model built after."""
    module = model.get_submodule(site)
    own = copy.copy(module)
    for key, value in vars(module).items():
        if isinstance(value, (dict, set)):
            own.__dict__[key] = copy.copy(value)
    parent, _, name = site.rpartition(".")
    model.get_submodule(parent)._modules[name] = own
    return own


def _delta(rng: random.Random, exact: bool) -> float:
    return 10 ** rng.uniform(-6, 0) if exact else rng.uniform(0.05, 1.0)


def _flip(tensor: torch.Tensor, index: int, bit: int) -> None:
    """Flips ``bit`` (a mantissa or exponent bit, never the sign) of element ``index`` of ``tensor``
    in place."""
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[tensor.dtype]
    with torch.no_grad():
        tensor.detach().view(-1).view(ints)[index] ^= 1 << bit


def _bit(rng: random.Random, dtype: torch.dtype, kind: str, exact: bool) -> int:
    """A bit to flip: any mantissa bit (exact) or one of the top three (mixed: delta above 0.05);
    one of the lowest three exponent bits (a factor 2, 4 or 16)."""
    mantissa = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}[dtype]
    if kind == "bitflip-exponent":
        return mantissa + rng.randrange(3)
    return rng.randrange(mantissa) if exact else mantissa - 1 - rng.randrange(3)


def plant(kind: FaultKind, model: torch.nn.Module, site: str, rng: random.Random, pair: Pair,
          steps: int) -> Fault:
    """Plants ``kind`` at ``site`` of ``model`` (its parameters drawn from ``rng``), switched on
    at a random step (a bit flip between steps)."""
    exact = pair.exact
    step = rng.randrange(1, steps) if kind.between_steps else rng.randrange(steps)
    name = kind.name
    if name.startswith("bitflip"):
        module_name, _, param_name = site.rpartition(".")
        param = model.get_submodule(module_name).get_parameter(param_name)
        index, bit = rng.randrange(param.numel()), _bit(rng, param.dtype, name, exact)
        fault = Fault(kind, site, Planted(module_name, step), f"bit {bit} of element {index}",
                      _on_step=lambda m: _flip(m.get_parameter(site), index, bit))
        return fault
    fault = Fault(kind, site, Planted(site, step), "")
    if name == "loss-bf16":  # at the loss, wherever it is computed (a loss module made in forward)
        fault.detail = "cross entropy in bf16"
        return fault
    module = _owned(model, site) if site else model
    if name == "scale-output":
        delta = _delta(rng, exact)
        fault.detail = f"x(1+{delta:.3g})"
        _wrap_forward(module, lambda f, *a, **k: _scaled(f(*a, **k), 1 + delta) if fault.active
                      else f(*a, **k))
    elif name == "overflow":
        fault.detail = "output past its dtype's largest value"
        _wrap_forward(module, lambda f, *a, **k: _overflowed(f(*a, **k)) if fault.active else f(*a, **k))
    elif name in ("cast-matmul", "cast-softmax"):
        functions = MATMULS if name == "cast-matmul" else SOFTMAXES

        def cast_calls(f: Callable[..., Any], *a: Any, **k: Any) -> Any:
            if not fault.active:
                return f(*a, **k)
            with _CastBefore(functions):
                return f(*a, **k)
        _wrap_forward(module, cast_calls)
        fault.detail = "inputs to bf16"
    elif name == "cast-norm":
        def cast_input(f: Callable[..., Any], x: Any, *a: Any, **k: Any) -> Any:
            # An input already in bf16 (a linear's output under autocast) has no cast to plant:
            # casting the norm's result back to it is what every transformers norm does under
            # autocast (``.to(input_dtype)``), no fault (MobileBERT's NoNorm, before).
            if not fault.active or x.dtype == LOW:
                return f(x, *a, **k)
            return f(x.to(LOW), *a, **k).to(x.dtype)
        _wrap_forward(module, cast_input)
        fault.detail = "input to bf16"
    elif name == "eps":
        attribute = next(a for a in NORM_ATTRIBUTES if isinstance(getattr(module, a, None), float))
        before = getattr(module, attribute)
        after = before * (1 + 1e3 * _delta(rng, exact)) if exact else max(before * 1e3, 1e-3)
        fault.detail = f"{attribute} {before:.3g} -> {after:.3g}"
        fault._on_step = lambda m: setattr(m.get_submodule(site) if site else m, attribute, after)
    elif name == "clip":
        fault.clip_factor = 1 - 0.95 * _delta(rng, exact)
        fault.detail = f"max_norm = {fault.clip_factor:.3g} x the norm"
    elif name == "dropout":
        p = min(0.5, _delta(rng, exact))
        fault.detail = f"p 0 -> {p:.3g}"
        fault._on_step = lambda m: setattr(m.get_submodule(site), "p", p)
    elif name == "mask-shift":
        fault.detail = "mask rolled by 1"
        fault._on_step = lambda m: _attention_fault(m, m.get_submodule(site), "mask_shift")
    elif name == "optimizer-fp16":
        fault.detail = "AdamW exp_avg_sq stored in fp16"
    else:
        raise ValueError(f"unknown fault kind {name!r}")
    return fault


@dataclass
class Policy:
    """How a run computes under a pair's precision policy: its model's dtype, its batches' and
    its autocast. The training of ``benchmarks.zoo`` and the dry forwards that choose a site."""

    pair: Pair

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.to(self.pair.model_dtype) if self.pair.model_dtype is not None else model

    def cast(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        dtype = self.pair.model_dtype
        return batch if dtype is None else {k: v.to(dtype) if v.is_floating_point() else v
                                            for k, v in batch.items()}

    def autocast(self) -> torch.autocast:
        return torch.autocast("cpu", dtype=self.pair.autocast or LOW, enabled=self.pair.autocast is not None)

    def loss(self, built: Built, model: torch.nn.Module, fault: Fault | None = None,
             grad: bool = False) -> torch.Tensor:
        """The loss of the first batch (torch's RNG left as it was; no gradients unless ``grad``)."""
        batch = self.cast(built.batch(torch.Generator().manual_seed(1)))
        around = fault.around_loss() if fault is not None else contextlib.nullcontext()
        with torch.random.fork_rng(), torch.set_grad_enabled(grad), self.autocast(), around:
            torch.manual_seed(2)
            return loss_of(model, batch).float()


def _unshifted(kind: FaultKind, built: Built, policy: Policy, site: str, clean: torch.Tensor) -> torch.Tensor:
    """What a site's fault is measured against: the clean loss; for ``mask-shift``, the loss of the
    same attention function without the shift. The fault swaps the module's attention for its
    own, whose rounding alone changes the loss; where the module has no mask (a bidirectional
    encoder's all-ones mask is dropped) or an all-equal one, nothing is shifted and there is no
    fault to find."""
    if kind.name != "mask-shift":
        return clean
    reference = policy.prepare(built.model(kind.attn))
    _attention_fault(reference, reference.get_submodule(site), "reimplemented")
    return policy.loss(built, reference)


def choose(kind: FaultKind, built: Built, pair: Pair, rng: random.Random,
           steps: int) -> tuple[str, int] | str:
    """A site where ``kind`` changes the first batch's loss under ``pair``'s run B, and the seed
    of its parameters; or why there is none (a sentence)."""
    policy = Policy(pair)
    model = policy.prepare(built.model(kind.attn))
    found = discover(model, lambda m: policy.loss(built, m))
    candidates = _candidates(kind.name, model, found)
    if not candidates:
        return f"no site for {kind.name}"
    clean = policy.loss(built, model)
    rng.shuffle(candidates)
    for site in candidates[:TRIES]:
        seed = rng.randrange(2**31)
        trial = policy.prepare(built.model(kind.attn))
        try:
            fault = plant(kind, trial, site, random.Random(seed), pair, steps)
            fault.before_step(trial, fault.planted.step)
            if kind.name in ("clip", "optimizer-fp16"):
                return site, seed  # no effect on a forward: the update is what it changes
            unfaulted = _unshifted(kind, built, policy, site, clean)
            if not torch.equal(policy.loss(built, trial, fault), unfaulted):
                return site, seed
        except Exception:  # a site the fault cannot be planted at (a norm refusing bf16) is not eligible
            continue
    return f"no site where {kind.name} changes the loss (of {len(candidates)})"
