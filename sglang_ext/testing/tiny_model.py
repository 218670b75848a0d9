"""Build a tiny random-weight Llama-style model directory that SGLang can serve.

Nothing is downloaded: the weights are drawn from a fixed-seed generator and the
tokenizer is a byte-level BPE trained with the ``tokenizers`` library on the
small corpus embedded below. The result is deterministic for a given
``TinyModelSpec`` (same files, same bytes), so tests can cache it per session.

Usage::

    from sglang_ext.testing.tiny_model import TinyModelSpec, build_tiny_model
    path = build_tiny_model(tmp_dir, TinyModelSpec())
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A cache keeps recent data close to the
processor so that the next read is fast. Large language models generate one token at a
time and keep the keys and values of every previous token in a key-value cache.
When the cache does not fit in device memory, some layers can live in host memory and
be copied back just before they are needed. The scheduler decides which requests run in
each step, and the planner decides where each layer of each request lives.
Time to first token measures how long a user waits for the first word; time between
tokens measures how steady the stream of words is. A service level objective says how
fast each of these must be. Short prompts and long documents share the same server.
Once upon a time there was a small model with random weights. It could not write
poetry, but it produced the same tokens every time it was asked the same question.
Numbers: zero one two three four five six seven eight nine ten eleven twelve.
Colors: red orange yellow green blue indigo violet black white gray brown pink.
Questions: what, why, how, when, where, who? Answers: because, therefore, so, thus.
User: hello! Assistant: hi, how can I help you today? User: tell me a story please.
"""

_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>")


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny Llama model; every field is validated in ``__post_init__``."""

    hidden_size: int = 64
    """Model width (must be a multiple of ``num_attention_heads``)."""
    num_hidden_layers: int = 4
    """Number of decoder layers."""
    num_attention_heads: int = 4
    """Query heads."""
    num_key_value_heads: int = 2
    """KV heads (GQA); must divide ``num_attention_heads``."""
    intermediate_size: int = 128
    """MLP width."""
    vocab_size: int = 512
    """Tokenizer and embedding vocabulary size."""
    max_position_embeddings: int = 2048
    """Longest context the config advertises."""
    seed: int = 0
    """Seed of the weight generator."""
    init_std: float = 0.05
    """Standard deviation of the random weights."""
    torch_dtype: str = "float32"
    """dtype written in config.json (float32 or bfloat16)."""

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"TinyModelSpec.{name}={value} must be >= 1")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"TinyModelSpec.hidden_size={self.hidden_size} must be a multiple of "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"TinyModelSpec.num_key_value_heads={self.num_key_value_heads} must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if not 300 <= self.vocab_size <= 8192:
            raise ValueError(f"TinyModelSpec.vocab_size={self.vocab_size} must be in [300, 8192]")
        if self.torch_dtype not in ("float32", "bfloat16"):
            raise ValueError(
                f"TinyModelSpec.torch_dtype={self.torch_dtype!r} must be 'float32' or 'bfloat16'"
            )
        if not 0.0 < self.init_std <= 1.0:
            raise ValueError(f"TinyModelSpec.init_std={self.init_std} must be in (0, 1]")

    @property
    def head_dim(self) -> int:
        """Per-head width."""
        return self.hidden_size // self.num_attention_heads


def _config(spec: TinyModelSpec) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": spec.torch_dtype,
    }


def _weights(spec: TinyModelSpec) -> dict:
    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    dtype = getattr(torch, spec.torch_dtype)
    h, inter, kv = spec.hidden_size, spec.intermediate_size, spec.num_key_value_heads * spec.head_dim

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * spec.init_std).to(dtype)

    tensors = {
        "model.embed_tokens.weight": rand(spec.vocab_size, h),
        "model.norm.weight": torch.ones(h, dtype=dtype),
        "lm_head.weight": rand(spec.vocab_size, h),
    }
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = torch.ones(h, dtype=dtype)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype)
        tensors[p + "self_attn.q_proj.weight"] = rand(h, h)
        tensors[p + "self_attn.k_proj.weight"] = rand(kv, h)
        tensors[p + "self_attn.v_proj.weight"] = rand(kv, h)
        tensors[p + "self_attn.o_proj.weight"] = rand(h, h)
        tensors[p + "mlp.gate_proj.weight"] = rand(inter, h)
        tensors[p + "mlp.up_proj.weight"] = rand(inter, h)
        tensors[p + "mlp.down_proj.weight"] = rand(h, inter)
    return tensors


def _train_tokenizer(spec: TinyModelSpec, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    if tok.get_vocab_size() > spec.vocab_size:
        raise ValueError(
            f"trained vocabulary has {tok.get_vocab_size()} tokens, more than "
            f"TinyModelSpec.vocab_size={spec.vocab_size}"
        )
    tok.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<unk>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position_embeddings,
        "chat_template": _CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<unk>"}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def build_tiny_model(directory: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Write config, weights and tokenizer for ``spec`` into ``directory``; return its path.

    Idempotent: if ``directory`` already holds a model built from the same spec
    (recorded in ``kvplane_tiny_spec.json``) it is returned unchanged.
    """
    from safetensors.torch import save_file

    spec = spec or TinyModelSpec()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    marker = out / "kvplane_tiny_spec.json"
    if marker.exists() and json.loads(marker.read_text()) == asdict(spec):
        return out
    (out / "config.json").write_text(json.dumps(_config(spec), indent=2))
    generation_config = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
    save_file(_weights(spec), str(out / "model.safetensors"), metadata={"format": "pt"})
    _train_tokenizer(spec, out)
    marker.write_text(json.dumps(asdict(spec), indent=2))
    return out
