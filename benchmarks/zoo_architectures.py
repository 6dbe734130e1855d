"""The zoo's architectures: every model class of transformers' Auto mappings for a task, built
from its default config shrunk to a tiny size, plus a small CNN with BatchNorm.

Nothing here is hand-picked: :func:`architectures` lists every entry of the mappings, and
:func:`build` shrinks the default config by generic rules (:func:`shrink_config`: widths,
depths, heads, vocabulary, experts, image and audio sizes, dropout off, recursively through
sub-configs), builds the model, and runs one forward and backward on a batch of the task's
inputs. An architecture that does not build that naively is kept with the reason
(:class:`NotBuilt`), so the zoo's table lists it instead of dropping it.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB = 64, 2, 4, 2, 16, 128, 512
BATCH, SEQ, IMAGE, PATCH, LABELS, AUDIO_SAMPLES = 2, 16, 32, 8, 10, 3200
MAX_PARAMS = 5_000_000
"""Models above this many parameters once shrunk are not built: the zoo stays CPU-affordable."""
BUILD_SECONDS = 120
"""A build (config, model, one forward and backward) that takes longer is given up."""
SPECIAL_IDS_FROM = VOCAB - 32
"""Token ids from here up are left to the config's special tokens (pad, bos, image, ...);
inputs are drawn below it, so that no input is read as a special token."""

TASKS = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq2seq-lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "audio-classification": "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
    "cnn": "",
}
"""The zoo's tasks and the Auto mapping (in ``transformers.models.auto.modeling_auto``) listing
each one's architectures; ``cnn`` is the zoo's own small CNN with BatchNorm."""

CNN = "cnn-batchnorm"


@dataclass(frozen=True)
class Architecture:
    """One entry of an Auto mapping: a model type and the class the mapping names for the task."""

    task: str
    model_type: str
    class_name: str

    @property
    def name(self) -> str:
        return self.model_type


def architectures(task: str) -> list[Architecture]:
    """Every architecture the Auto mapping of ``task`` lists, sorted by model type."""
    if task == "cnn":
        return [Architecture("cnn", CNN, "BatchNormCNN")]
    from transformers.models.auto import modeling_auto

    mapping: dict[str, Any] = getattr(modeling_auto, TASKS[task])
    archs = []
    for model_type, names in sorted(mapping.items()):
        name = names[0] if isinstance(names, (tuple, list)) else names
        archs.append(Architecture(task, model_type, name))
    return archs


# --------------------------------------------------------------------------- shrinking

_WIDTH = ("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "model_dim", "word_embed_proj_dim",
          "embedding_size", "hidden_dim", "projection_dim", "text_hidden_size", "vision_hidden_size",
          "attention_hidden_size", "output_hidden_size", "encoder_hidden_size", "pooler_hidden_size",
          "classifier_proj_size", "conv_dim_out", "audio_hidden_size", "d_inner_hidden", "emb_dim",
          "entity_emb_size", "d_latents")
_DEPTH = ("num_hidden_layers", "n_layer", "num_layers", "encoder_layers", "decoder_layers", "n_layers",
          "num_encoder_layers", "num_decoder_layers", "num_text_layers", "depth", "num_blocks")
_HEADS = ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads", "decoder_attention_heads",
          "n_heads", "attention_heads", "num_decoder_attention_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "n_kv_heads",
             "linear_num_key_heads")
_INTERMEDIATE = ("intermediate_size", "ffn_dim", "d_ff", "n_inner", "encoder_ffn_dim", "decoder_ffn_dim",
                 "ffn_hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                 "intermediate_size_mlp", "shared_intermediate_size", "shared_experts_intermediate_size",
                 "d_inner", "expert_intermediate_size", "mlp_dim")
_HEAD_DIMS = ("head_dim", "d_kv", "kv_channels", "qk_nope_head_dim", "v_head_dim", "linear_key_head_dim",
              "linear_value_head_dim", "index_head_dim", "swa_head_dim", "attention_head_size", "dim_head",
              "mamba_head_dim", "global_head_dim", "rotary_dim")
_SMALL = {
    "qk_rope_head_dim": 8, "kv_lora_rank": 32, "q_lora_rank": 32, "num_experts": 4, "num_local_experts": 4,
    "n_routed_experts": 4, "moe_num_experts": 4, "num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2,
    "n_shared_experts": 1, "num_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "linear_num_value_heads": 4, "mamba_n_heads": 4, "mamba_d_state": 16, "ssm_state_size": 16,
    "mamba_chunk_size": 16, "chunk_size": 16, "mamba_expand": 2, "state_size": 16, "time_step_rank": 8,
    "mamba_dt_rank": 8, "index_topk": 8, "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 4,
    "tdnn_dim_out": 32, "xvector_output_dim": 32, "codevector_dim": 32, "proj_codevector_dim": 32,
    "num_codevectors_per_group": 16, "max_source_positions": 32, "max_target_positions": 64,
    "num_mel_bins": 16, "max_length": 32, "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 64,
    "num_labels": LABELS, "query_pre_attn_scalar": HEAD_DIM, "num_key_value_groups": 2,
    "relative_attention_num_buckets": 8, "relative_attention_max_distance": 32, "conv_kernel": 4,
    "num_latents": 32, "num_groups": 8, "window_size": 4,
}
"""Other sizes, set where a default config has them (an int that is not None): ``num_groups``, a
group norm's, divides the stage widths (at least 8, below); ``window_size`` fits the last stage of
the shrunk image (32 / patch 4 / 2)."""
_ZERO_FLOATS = ("dropout", "pdrop", "drop_path", "layerdrop", "_prob", "dropout_rate", "drop_rate",
                "router_jitter_noise")
"""Probabilities of dropping something, and SpecAugment's of masking audio frames and features
(``mask_time_prob``): random in training, off in the zoo's healthy runs."""
_TOKEN_ID = ("token_id", "token_index", "start_token", "end_token")


def _is_zeroed(key: str, value: Any) -> bool:
    """Dropout and the like: every float probability of dropping or masking something is set to 0."""
    return isinstance(value, float) and any(part in key for part in _ZERO_FLOATS) and "initializer" not in key


def _shrunk_list(key: str, value: list[Any], layers: int | None) -> list[Any]:
    """Per-layer lists (their length is the layer count) keep their first LAYERS entries; lists
    of stage widths are scaled down to at most HIDDEN; stage depths become 1."""
    if layers is not None and len(value) == layers and layers > LAYERS:
        # The first layer, then the first one unlike it (a hybrid keeps one layer of each kind);
        # a list of stages (Swin's depths and heads) is then shrunk as stages below.
        other = next((v for v in value if v != value[0]), value[1])
        value = [value[0], other, *value[1:LAYERS - 1]]
    if not value or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return value
    if key in ("hidden_sizes", "embed_dims", "embed_dim", "neck_hidden_sizes", "stage_out_channels",
               "stage_in_channels", "stage_mid_channels", "conv_dim", "tdnn_dim"):
        top = max(value)
        factor = max(1, top // HIDDEN)
        return [max(8, v // factor) for v in value]
    if key in ("depths", "depth", "num_block_repeats", "stage_num_blocks", "block_repeats", "block_sizes"):
        return [1 for _ in value]
    if key in ("num_heads", "num_attention_heads"):
        return [min(v, 2) for v in value]
    return value


def shrink_config(values: dict[str, Any]) -> dict[str, Any]:
    """A config's ``to_dict()`` with every size the generic rules know set small (recursively:
    sub-configs, such as ``text_config`` and ``vision_config``, are dicts here too)."""
    layers = next((values[k] for k in _DEPTH if isinstance(values.get(k), int)), None)
    heads_before = next((values[k] for k in _HEADS if isinstance(values.get(k), int)), None)
    vocab_before = values.get("vocab_size")
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key == "out_features":
            out[key] = None  # a backbone's stages past the shrunk depth: its default, the last stage
            continue
        if key == "out_indices" and isinstance(value, list):
            out[key] = [i for i in value if isinstance(i, int) and 0 <= i <= LAYERS] or [LAYERS]
            continue
        if key == "per_layer_config" and isinstance(value, dict):
            out[key] = {k: v for k, v in value.items() if int(k) < LAYERS}
            continue
        if isinstance(value, dict) and key not in ("rope_scaling", "rope_parameters", "id2label", "label2id"):
            out[key] = shrink_config(value)
            continue
        if isinstance(value, list):
            out[key] = _shrunk_list(key, value, layers)
            continue
        if _is_zeroed(key, value):
            out[key] = 0.0
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            out[key] = value
            continue
        if key in _WIDTH:
            out[key] = min(value, HIDDEN) if key != "classifier_proj_size" else min(value, 32)
        elif key in _DEPTH:
            out[key] = min(value, LAYERS)
        elif key in _HEADS:
            out[key] = min(value, HEADS)
        elif key in _KV_HEADS:
            # Multi-query stays multi-query; grouped and full attention keep their kind.
            out[key] = 1 if value == 1 else (HEADS if value == heads_before else min(value, KV_HEADS))
        elif key in _INTERMEDIATE:
            out[key] = min(value, INTERMEDIATE)
        elif key in _HEAD_DIMS:
            out[key] = min(value, HEAD_DIM)
        elif key in _SMALL:
            out[key] = min(value, _SMALL[key]) if key != "num_labels" else _SMALL[key]
        elif key in ("vocab_size", "text_vocab_size", "n_vocab", "decoder_vocab_size", "entity_vocab_size"):
            out[key] = min(value, VOCAB)
        elif key in ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length",
                     "max_sequence_length", "context_length", "block_size"):
            out[key] = min(value, 512)
        elif key == "image_size":
            out[key] = IMAGE
        elif key == "patch_size":
            out[key] = min(value, PATCH)
        elif key == "qk_head_dim":
            out[key] = 2 * HEAD_DIM  # nope + rope, derived from the two above (16 + 8), rounded up
        elif vocab_before is not None and any(part in key for part in _TOKEN_ID) and value >= VOCAB:
            out[key] = value  # moved below by _special_ids, once every key is known
        else:
            out[key] = value
    if isinstance(out.get("qk_head_dim"), int) and "qk_nope_head_dim" in out and "qk_rope_head_dim" in out:
        out["qk_head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    if isinstance(values.get("image_size"), (list, tuple)):
        out["image_size"] = [IMAGE, IMAGE]
    if isinstance(values.get("patch_size"), (list, tuple)):
        out["patch_size"] = [PATCH, PATCH]
    _special_ids(out)
    out.pop("output_router_logits", None)  # auxiliary losses over the batch stay off (the default)
    return out


def _special_ids(values: dict[str, Any]) -> None:
    """Token ids beyond the shrunk vocabulary move into its top (distinct ids, in key order)."""
    vocab = values.get("vocab_size")
    if not isinstance(vocab, int):
        return
    free = iter(range(SPECIAL_IDS_FROM, vocab))
    moved: dict[int, int] = {}
    for key, value in list(values.items()):
        if not isinstance(key, str) or not any(part in key for part in _TOKEN_ID):
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value >= SPECIAL_IDS_FROM:
            if value not in moved:
                moved[value] = next(free, vocab - 1)
            values[key] = moved[value]
        elif isinstance(value, list) and all(isinstance(v, int) for v in value):
            values[key] = [moved.setdefault(v, next(free, vocab - 1)) if v >= SPECIAL_IDS_FROM else v
                           for v in value]


def special_token_ids(config: Any) -> set[int]:
    """Every token id a config (and its sub-configs) names: inputs avoid them."""
    ids: set[int] = set()
    values = config.to_dict() if hasattr(config, "to_dict") else config

    def walk(d: dict[str, Any]) -> None:
        for key, value in d.items():
            if isinstance(value, dict):
                walk(value)
            elif isinstance(key, str) and any(part in key for part in _TOKEN_ID):
                for v in value if isinstance(value, list) else [value]:
                    if isinstance(v, int) and not isinstance(v, bool):
                        ids.add(v)
    walk(values)
    return ids


# --------------------------------------------------------------------------- building


class BuildTimeout(Exception):
    """The build took longer than BUILD_SECONDS."""


@contextlib.contextmanager
def _time_limit(seconds: int) -> Iterator[None]:
    """SIGALRM after ``seconds`` (the main thread only; elsewhere no limit)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise BuildTimeout(f"took over {seconds} s")
    before = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)


@dataclass
class NotBuilt:
    """An architecture the zoo could not build, and why (one line)."""

    arch: Architecture
    reason: str


@dataclass
class Built:
    """A built architecture: how to make its model again (seeded), its batches and its loss."""

    arch: Architecture
    config: Any
    """The shrunk config (None for the CNN)."""
    params: int
    attentions: tuple[str, ...]
    """The attention implementations it builds with: its default first, then "eager" when the
    default is another one ("eager vs sdpa where both exist")."""

    def model(self, attn: str | None = None, seed: int = 0) -> torch.nn.Module:
        """A fresh model, the same weights for the same seed; ``attn`` None is the default."""
        torch.manual_seed(seed)
        if self.config is None:
            return BatchNormCNN()
        import copy

        import transformers

        config = copy.deepcopy(self.config)
        cls = getattr(transformers, self.arch.class_name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if attn is None:
                return cls(config)
            return cls._from_config(config, attn_implementation=attn)

    def batch(self, gen: torch.Generator, batch: int = BATCH) -> dict[str, torch.Tensor]:
        """A batch of the task's inputs and labels, drawn from ``gen``."""
        return task_batch(self.arch, self.config, gen, batch)

    @functools.cached_property
    def has_batchnorm(self) -> bool:
        """Whether a module normalises over the batch: gradient accumulation then changes the
        computation (its micro-batches' statistics), so that pair does not apply. Read from the
        model's modules, not its config: wav2vec2-conformer's convolution module has a BatchNorm
        that no config key names. (Built once per architecture: every case asks.)"""
        if self.config is None:
            return True
        with torch.random.fork_rng(devices=[]):  # (building seeds torch's generator)
            model = self.model()
        return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def loss_of(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The training loss: the model's own (transformers computes it from ``labels``)."""
    if isinstance(model, BatchNormCNN) or isinstance(getattr(model, "_orig_mod", None), BatchNormCNN):
        return torch.nn.functional.cross_entropy(model(batch["pixel_values"]), batch["labels"])
    out = model(**batch)
    loss = out.loss if hasattr(out, "loss") else out["loss"]
    if loss is None:
        raise ValueError("the model returned no loss for its labels")
    return loss


def _config_value(config: Any, *names: str, default: Any = None) -> Any:
    """The first of ``names`` set on ``config`` or on one of its sub-configs."""
    for holder in (config, *(getattr(config, s, None) for s in
                             ("vision_config", "audio_config", "encoder_config", "text_config"))):
        if holder is None:
            continue
        for name in names:
            value = getattr(holder, name, None)
            if value is not None:
                return value
    return default


def task_batch(arch: Architecture, config: Any, gen: torch.Generator, batch: int) -> dict[str, torch.Tensor]:
    """Inputs for ``arch``'s main input (token ids, pixels, raw audio or audio features) and
    labels for its task; token ids avoid every special token the config names."""
    if arch.task in ("image-classification", "cnn"):
        size = _config_value(config, "image_size", default=IMAGE) if config is not None else IMAGE
        size = size[0] if isinstance(size, (list, tuple)) else size
        channels = _config_value(config, "num_channels", default=3) if config is not None else 3
        return {"pixel_values": torch.randn(batch, channels, size, size, generator=gen),
                "labels": torch.randint(0, LABELS, (batch,), generator=gen)}
    if arch.task == "audio-classification":
        labels = torch.randint(0, LABELS, (batch,), generator=gen)
        if arch.model_type == "audio-spectrogram-transformer":
            frames, bins = config.max_length, config.num_mel_bins
            return {"input_values": torch.randn(batch, frames, bins, generator=gen), "labels": labels}
        if arch.model_type == "whisper":
            frames = 2 * config.max_source_positions
            return {"input_features": torch.randn(batch, config.num_mel_bins, frames, generator=gen),
                    "labels": labels}
        return {"input_values": torch.randn(batch, AUDIO_SAMPLES, generator=gen), "labels": labels}
    vocab = min(_config_value(config, "vocab_size", default=VOCAB), SPECIAL_IDS_FROM)
    allowed = torch.tensor([i for i in range(vocab) if i not in special_token_ids(config)])
    ids = allowed[torch.randint(0, len(allowed), (batch, SEQ), generator=gen)]
    if arch.task == "seq2seq-lm":
        labels = allowed[torch.randint(0, len(allowed), (batch, SEQ), generator=gen)]
        return {"input_ids": ids, "labels": labels}
    return {"input_ids": ids, "labels": ids.clone()}


def shrunk(arch: Architecture) -> Any:
    """``arch``'s default config, shrunk."""
    import transformers

    config_cls = transformers.CONFIG_MAPPING[arch.model_type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        values = shrink_config(config_cls().to_dict())
        if arch.task == "seq2seq-lm" and values.get("decoder_start_token_id") is None:
            values["decoder_start_token_id"] = values.get("pad_token_id") or 0  # T5's default has none
        if arch.task in ("image-classification", "audio-classification"):
            values["num_labels"] = LABELS
            values.pop("id2label", None)
            values.pop("label2id", None)
        return config_cls.from_dict(values)


def build(arch: Architecture) -> Built | NotBuilt:
    """Builds ``arch`` shrunk and runs one forward and backward (seeded); the reason otherwise."""
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        with _time_limit(BUILD_SECONDS), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = None if arch.task == "cnn" else shrunk(arch)
            probe_built = Built(arch, config, 0, ())
            if config is not None:
                import transformers

                cls = getattr(transformers, arch.class_name)
                with torch.device("meta"):
                    params = sum(p.numel() for p in cls(config).parameters())
                if params > MAX_PARAMS:
                    return NotBuilt(arch, f"too large once shrunk: {params / 1e6:.1f}M parameters")
            model = probe_built.model()
            params = sum(p.numel() for p in model.parameters())
            gen = torch.Generator().manual_seed(1)
            loss = loss_of(model, probe_built.batch(gen))
            loss.backward()
            if not torch.isfinite(loss):
                return NotBuilt(arch, f"non-finite loss {loss.item()}")
            default = getattr(getattr(model, "config", None), "_attn_implementation", None) or "eager"
            attentions = (default,) if default == "eager" else (default, "eager")
            return Built(arch, config, params, attentions)
    except Exception as e:  # every failure is a row of the table, with its reason
        return NotBuilt(arch, first_line(e))


def first_line(e: BaseException) -> str:
    """An exception in one line: its type and its message's first line."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160] if text else ''}"


# --------------------------------------------------------------------------- the CNN


class BatchNormCNN(torch.nn.Module):
    """A small CNN with BatchNorm (convolutions, batch statistics, running buffers): the zoo's
    one architecture outside transformers."""

    def __init__(self, channels: int = 16, classes: int = LABELS) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, channels, 3, padding=1)
        self.bn1 = torch.nn.BatchNorm2d(channels)
        self.conv2 = torch.nn.Conv2d(channels, 2 * channels, 3, stride=2, padding=1)
        self.bn2 = torch.nn.BatchNorm2d(2 * channels)
        self.pool = torch.nn.AdaptiveAvgPool2d(1)
        self.head = torch.nn.Linear(2 * channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.head(self.pool(x).flatten(1))

