"""The recompute rows are cut at each decoder layer with SGLang's own residual stream (no server).

``RecomputeForward.wrap_layers`` (eLLM §4.3.1, ``docs/recompute.md``): at a layer's entry the
rows of prefixes recomputed only below it are cut from the hidden states, the positions and
``forward_batch.residual_stream`` -- SGLang 0.5.23's :class:`ResidualStream` and
:class:`Contribution`, used here as the model uses them. The served proof (rows per layer = k * u
on a real server) is ``tests/sglang/test_recompute_server.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.layers.layer_boundary.residual.add_norm import PLAIN_ADD, REPLACE_AT_EXIT  # noqa: E402
from sglang.srt.layers.layer_boundary.residual.stream import DeclaredSum, ResidualStream  # noqa: E402

from sglang_ext.recompute_forward import RecomputeForward, _cut_stream  # noqa: E402

ROWS, HIDDEN = 6, 4


def _pending_stream(update=PLAIN_ADD, declared_sum=None):  # noqa: ANN001, ANN202
    residual = torch.arange(ROWS * HIDDEN, dtype=torch.float32).view(ROWS, HIDDEN)
    stream = ResidualStream(residual)
    out = torch.ones(ROWS, HIDDEN)
    handle = stream.record(out, update, declared_sum=declared_sum)
    return stream, handle, residual


def test_a_written_residual_is_cut():
    residual = torch.randn(ROWS, HIDDEN)
    stream = ResidualStream(residual)
    cut = _cut_stream(residual, SimpleNamespace(residual_stream=stream), 4)
    assert cut is not None and cut.shape[0] == 4 and torch.equal(cut, residual[:4])
    stream.check(cut)  # SGLang accepts the cut tensor as the layer's input
    assert stream.residual.shape[0] == 4


def test_a_pending_plain_add_is_cut_and_applies_to_the_kept_rows():
    stream, handle, residual = _pending_stream()
    cut = _cut_stream(handle, SimpleNamespace(residual_stream=stream), 3)
    assert cut is not None and cut.shape[0] == 3
    value, res = stream.input(cut)  # what the next layer's prepare reads
    assert value.shape[0] == res.shape[0] == 3
    assert torch.equal(PLAIN_ADD.update(value.clone(), res), residual[:3] + 1)
    # negative control: the uncut residual would have all the rows
    assert residual.shape[0] == ROWS


def test_an_owed_sum_is_completed_first():
    calls = []

    def complete_sum(value):  # noqa: ANN001, ANN202 - the producer's custom sum (TP all-reduce here)
        calls.append(value.shape[0])
        return value * 2

    group = SimpleNamespace()
    stream, handle, _ = _pending_stream(declared_sum=DeclaredSum(group, complete_sum))
    cut = _cut_stream(handle, SimpleNamespace(residual_stream=stream), 2)
    assert calls == [ROWS]  # the sum ran over every row, before the cut
    assert cut is not None and torch.equal(cut, torch.full((2, HIDDEN), 2.0))
    stream.check(cut)


@pytest.mark.parametrize("case", ["replace_at_exit", "transport", "foreign_hidden", "no_stream"])
def test_states_a_cut_cannot_carry_are_left_alone(case):
    stream, handle, residual = _pending_stream(REPLACE_AT_EXIT if case == "replace_at_exit" else PLAIN_ADD)
    hidden = handle
    if case == "transport":
        stream.transport = (None, None)
    if case == "foreign_hidden":
        hidden = torch.ones(ROWS, HIDDEN)
    batch = SimpleNamespace(residual_stream=None if case == "no_stream" else stream)
    assert _cut_stream(hidden, batch, 2) is None
    assert stream.residual is residual and stream.pending.value.shape[0] == ROWS


class _Layer(torch.nn.Module):
    """Records the rows it receives; prepares, writes and records the residual stream as SGLang's
    layers do."""

    def __init__(self, i: int, seen: list[tuple[int, int]]) -> None:
        super().__init__()
        self.i, self.seen = i, seen

    def forward(self, positions, hidden_states, forward_batch):  # noqa: ANN001, ANN201
        self.seen.append((self.i, positions.shape[0]))
        stream = forward_batch.residual_stream
        value, residual = stream.input(hidden_states)  # the layer's prepare: consume, write
        assert value.shape[0] == positions.shape[0]
        stream.write(value if residual is None else value + residual)
        return stream.record(torch.ones(positions.shape[0], HIDDEN), PLAIN_ADD)


def _rows_per_layer(model, seen, by_name: bool = False) -> list[tuple[int, int]]:  # noqa: ANN001
    """One forward of 7 rows through ``model``'s layers; the rows each layer received."""
    seen.clear()
    batch, hidden, positions = SimpleNamespace(residual_stream=ResidualStream()), torch.zeros(7, HIDDEN), torch.arange(7)
    for layer in model.model.layers:
        if by_name:
            hidden = layer(positions, hidden_states=hidden, forward_batch=batch)
        else:
            hidden = layer(positions, hidden, batch)
    return list(seen)


def _stack(seen: list) -> SimpleNamespace:
    return SimpleNamespace(model=SimpleNamespace(layers=torch.nn.ModuleList(_Layer(i, seen) for i in range(4)),
                                                 start_layer=0))


CUT = [(0, 7), (1, 7), (2, 5), (3, 2)]
"""Rows per layer with active [5, 5, 3, 0] and 2 decode rows: prefixes of 3 (k = 3) and 2 (k = 2)."""


def test_wrap_layers_cuts_at_each_layer_by_the_active_rows():
    """A stack of four layers recording the rows they receive; rows ordered by decreasing k."""
    seen: list[tuple[int, int]] = []
    model = _stack(seen)
    rec = RecomputeForward()
    assert rec.wrap_layers(model) == 3
    assert rec.wrap_layers(model) == 0  # once
    rec.batch = 2
    rec.rows = SimpleNamespace(active=[5, 5, 3, 0])
    assert _rows_per_layer(model, seen) == CUT
    rec.rows = None  # a step without recompute: every row everywhere (the negative control)
    assert _rows_per_layer(model, seen) == [(i, 7) for i in range(4)]


@pytest.mark.parametrize("by_name", [False, True], ids=["positional", "keywords"])
def test_the_cut_outlives_a_weight_offloaders_forward(by_name):
    """Scenario (session 81's note): SGLang's ``--cpu-offload-gb`` weight offloader
    (``OffloaderV1``; ``_hook_module_forward_raw``, as V2's) puts its own ``forward`` back on the
    layer after every call, so a cut set over theirs lasted one forward: later steps ran the
    recompute rows through every layer (right, zeroed above ``k``, but none of eLLM's saving).
    Such layers get the cut as a forward pre-hook: every forward is cut, whether SGLang passes the
    call by position or by name. Control: the plain wrapper over the offloader's (the code before)
    cuts the first forward only."""
    from sglang.srt.utils.offloader import _hook_module_forward_raw

    results = {}
    for hooked in (True, False):
        seen: list[tuple[int, int]] = []
        model = _stack(seen)
        for layer in model.model.layers:  # as the offloaders do at model build
            _hook_module_forward_raw(layer, on_forward_end=lambda: None, get_parameter_and_buffer_dicts=dict)
        rec = RecomputeForward()
        if hooked:
            assert rec.wrap_layers(model) == 3
        else:
            for i, layer in enumerate(model.model.layers[1:], start=1):
                layer.forward = rec._cutting(layer.forward, i)
        rec.batch, rec.rows = 2, SimpleNamespace(active=[5, 5, 3, 0])
        results[hooked] = [_rows_per_layer(model, seen, by_name) for _ in range(3)]
        if hooked:
            rec.rows = None
            assert _rows_per_layer(model, seen, by_name) == [(i, 7) for i in range(4)]
    assert results[True] == [CUT] * 3
    assert results[False][0] == CUT and results[False][1] == [(i, 7) for i in range(4)]


def test_layers_of_another_call_are_not_wrapped_and_recompute_is_not_offered():
    """Scenario: under ``--model-impl transformers`` SGLang serves Hugging Face decoder layers,
    called ``(hidden_states, attention_mask=..., position_ids=...)``; wrapped as SGLang layers,
    the server's first forward raised TypeError (flag audit, session 81). Such layers are left
    alone and :meth:`RecomputeForward.layers_fit` says no (the backend then offers no recompute).
    Control: SGLang's own Llama decoder layers of the same config fit and are wrapped."""
    from sglang.srt.models.llama import LlamaDecoderLayer as SGLangLayer
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer as HFLayer

    config = LlamaConfig(hidden_size=32, intermediate_size=32, num_attention_heads=4, num_key_value_heads=1)
    hf = SimpleNamespace(model=SimpleNamespace(layers=torch.nn.ModuleList(HFLayer(config, i) for i in range(3))))
    assert not RecomputeForward.layers_fit(hf)
    assert RecomputeForward().wrap_layers(hf) == 0
    hidden = torch.randn(1, 5, 32)  # the HF call still works: nothing wrapped
    out = hf.model.layers[1](hidden, attention_mask=None, position_ids=torch.arange(5)[None],
                             position_embeddings=(torch.ones(1, 5, 8), torch.zeros(1, 5, 8)))
    assert (out[0] if isinstance(out, tuple) else out).shape == hidden.shape

    class Shaped(torch.nn.Module):  # SGLang's call, as the signature check reads it
        forward = SGLangLayer.forward

    native = SimpleNamespace(model=SimpleNamespace(layers=torch.nn.ModuleList(Shaped() for _ in range(3)),
                                                   start_layer=0))
    assert RecomputeForward.layers_fit(native)
    assert RecomputeForward().wrap_layers(native) == 2
    assert RecomputeForward.layers_fit(SimpleNamespace(model=SimpleNamespace()))  # no stack: nothing to wrap


def test_the_recompute_flag_refusal_names_the_reason_per_model():
    """``--kv-recompute-ratio`` where the forward cannot carry recompute rows is refused at start
    (``LayeredAttention``), naming the flag, the model class and the reason: a soft cap or window
    (Gemma-2), layers of another call (OPT, or Hugging Face's), no logits processor."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer as HFLayer

    class Capped(torch.nn.Module):
        pass

    capped = RecomputeForward.refusal(Capped(), 0.5, True)
    assert capped.startswith("--kv-recompute-ratio=0.5: eLLM's recompute cannot run in Capped's forward")
    assert "soft-caps or windows" in capped and "drop the flag" in capped
    config = LlamaConfig(hidden_size=32, intermediate_size=32, num_attention_heads=4, num_key_value_heads=1)
    hf = SimpleNamespace(model=SimpleNamespace(layers=torch.nn.ModuleList([HFLayer(config, 0)])))
    assert "do not take SGLang's layer call" in RecomputeForward.refusal(hf, 0.5, False)
    assert "logits_processor" in RecomputeForward.refusal(SimpleNamespace(), 0.5, False)


def test_layers_whose_forward_an_offloader_wrapped_still_fit():
    """Scenario (review of session 81's fix): SGLang's weight offloaders (``--cpu-offload-gb``,
    ``--offload-group-size``) replace each decoder layer's ``forward`` with ``forward(*args,
    **kwargs)`` when the model is built; read from the instance, SGLang's own Llama and Qwen2
    layers then looked like another call and recompute was switched off (its flag refused naming
    the Transformers backend). The call is read from the layer's class. Control: a layer class of
    another call (Hugging Face's) still does not fit, wrapped or not."""
    from sglang.srt.models.llama import LlamaDecoderLayer
    from sglang.srt.models.qwen2 import Qwen2DecoderLayer
    from sglang.srt.utils.offloader import _hook_module_forward_raw
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer as HFLayer

    def bare(cls):  # noqa: ANN001, ANN202 - the class without its weights (the call is all that is read)
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        return layer

    config = LlamaConfig(hidden_size=32, intermediate_size=32, num_attention_heads=4, num_key_value_heads=1)
    for make, fits in ((lambda: bare(LlamaDecoderLayer), True), (lambda: bare(Qwen2DecoderLayer), True),
                       (lambda: HFLayer(config, 0), False)):
        layers = torch.nn.ModuleList(make() for _ in range(3))
        model = SimpleNamespace(model=SimpleNamespace(layers=layers, start_layer=0))
        for layer in layers:  # as OffloaderV2 does at model build (V1's wrapper takes the same call)
            _hook_module_forward_raw(layer, on_forward_end=lambda: None, get_parameter_and_buffer_dicts=dict)
        assert RecomputeForward.layers_fit(model) is fits, type(layers[0]).__name__
        assert RecomputeForward().wrap_layers(model) == (2 if fits else 0)


def test_the_transformers_backend_never_fits_even_without_a_layer_stack():
    """A model class of SGLang's Transformers backend (it derives from ``TransformersBase``) is
    never offered recompute, whatever its Hugging Face backbone names its layers (GPT-2's ``h``:
    no ``model.layers`` stack, which elsewhere means nothing to wrap), and the refusal names the
    backend. Control: the same object without that base fits."""
    from sglang.srt.models.transformers import TransformersBase

    class OnTheBackend(TransformersBase):
        def __init__(self) -> None:
            torch.nn.Module.__init__(self)
            self.model = SimpleNamespace(h=[])

    class Native(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = SimpleNamespace(h=[])

    assert not RecomputeForward.layers_fit(OnTheBackend())
    assert "SGLang's Transformers backend (--model-impl transformers)" in RecomputeForward.refusal(
        OnTheBackend(), 0.5, False)
    assert RecomputeForward.layers_fit(Native())
