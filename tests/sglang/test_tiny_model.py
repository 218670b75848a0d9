"""The tiny model builder: deterministic, validated, loadable tokenizer with a chat template."""

from __future__ import annotations

import hashlib
import json

import pytest

from sglang_ext.testing.tiny_model import TinyModelSpec, build_tiny_model


def _digest(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_build_is_deterministic(tmp_path, tiny_model_dir):
    """Two builds of the same spec produce byte-identical files."""
    again = build_tiny_model(tmp_path / "again", TinyModelSpec())
    assert _digest(again) == _digest(tiny_model_dir)


def test_config_matches_spec(tiny_model_dir):
    """config.json is a Llama config with the spec's tiny dimensions."""
    spec = TinyModelSpec()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] == spec.hidden_size
    assert config["num_key_value_heads"] == spec.num_key_value_heads
    assert config["vocab_size"] == spec.vocab_size


def test_tokenizer_round_trips_and_has_chat_template(tiny_model_dir):
    """The locally trained tokenizer round-trips text and renders the chat template."""
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_model_dir))
    text = "The quick brown fox jumps over the lazy dog."
    assert tok.decode(tok(text)["input_ids"]) == text
    assert len(tok) <= TinyModelSpec().vocab_size
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == "<|user|>hi<|end|><|assistant|>"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hidden_size": 65}, "must be a multiple of num_attention_heads"),
        ({"num_key_value_heads": 3}, "must divide num_attention_heads"),
        ({"vocab_size": 100}, "vocab_size=100 must be in [300, 8192]"),
        ({"torch_dtype": "float16"}, "must be 'float32' or 'bfloat16'"),
        ({"num_hidden_layers": 0}, "num_hidden_layers=0 must be >= 1"),
    ],
)
def test_spec_rejects_bad_shapes(kwargs, message):
    """Bad spec fields raise ValueError naming the field and the allowed range."""
    with pytest.raises(ValueError) as info:
        TinyModelSpec(**kwargs)
    assert message in str(info.value)
