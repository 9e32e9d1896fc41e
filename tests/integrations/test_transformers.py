"""numba_flash.integrations.transformers: attn_implementation="numba_flash" in tiny models
built from configs (random weights, no download): Llama (GQA), Mistral (a sliding window
shorter than the sequence), Gemma 2 (softcap, sliding and global layers), Qwen2. Logits and
the gradients of one training step, the Numba kernels in the simulator, against float64
eager attention by the accuracy rule (the baseline: float32 eager attention), Llama and
Qwen2 with a left-padded batch (transformers un-pads it into packed sequences: our varlen
kernels; against numba_flash's float64 reference through the same model, since eager
attention's padding rows get NaN gradients); greedy generate() of 32 tokens with the
default cache giving the reference's tokens (the numpy backend, float64: the integration's
logic, each decode step's un-padding and cache, at a price the simulator could not pay)."""
import copy
import os
import subprocess
import sys

import pytest
from error_rule import assert_within_rule

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import numba_flash.integrations.transformers as numba_transformers  # noqa: E402

SEQLEN, VOCAB = 12, 64
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             max_position_embeddings=128, attention_dropout=0.0)


def _configs():
    """{name: (config, the implementation generate() is compared with (SDPA where it takes
    the model's options), whether its batch is left-padded)}:
    the windowed models' batches are not padded, since with left padding transformers'
    FlashAttention path (ours) counts a window in tokens where eager and SDPA count positions,
    pads among them (FlashAttention-2's behaviour in transformers, not a kernel's)."""
    return {
        "llama-gqa": (transformers.LlamaConfig(**SMALL), "sdpa", True),
        "mistral-window": (transformers.MistralConfig(**SMALL, sliding_window=5), "sdpa", False),
        "gemma2-softcap": (transformers.Gemma2Config(
            **SMALL, sliding_window=5, attn_logit_softcapping=2.0, final_logit_softcapping=30.0,
            query_pre_attn_scalar=16), "eager", False),
        "qwen2": (transformers.Qwen2Config(**SMALL), "sdpa", True),
    }


MODELS = list(_configs())


@pytest.fixture
def registered():
    """register() with a backend, put back to "auto" after the test."""
    def register(backend):
        numba_transformers.register(backend=backend)
    yield register
    numba_transformers.register()


def _models(name, implementations, dtype):
    """The same random weights under each attn_implementation, in dtype."""
    config, _, _ = _configs()[name]
    torch.manual_seed(0)
    models = [transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                            attn_implementation=impl)
              for impl in implementations]
    for model in models[1:]:
        model.load_state_dict(models[0].state_dict())
    return [model.to(dtype) for model in models]


def _batch(gen, padded):
    """Token ids (2, SEQLEN) and the attention mask: the second row left-padded by 4."""
    ids = torch.randint(0, VOCAB, (2, SEQLEN), generator=gen)
    mask = torch.ones(2, SEQLEN, dtype=torch.long)
    if padded:
        mask[1, :4] = 0
    return ids, mask


def _step(model, ids, mask):
    """Logits and every parameter's gradient of one training step's loss."""
    model.zero_grad()
    labels = ids.masked_fill(mask == 0, -100)
    out = model(ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    keep = mask.bool()
    return out.logits.detach()[keep], grads


@pytest.mark.parametrize("name", MODELS)
def test_logits_and_gradients_match_eager_attention(registered, rng, name):
    """The kernels (numba, simulator, float32) inside the model, by the accuracy rule against
    float64 eager attention, with float32 eager attention as the baseline; for a left-padded
    batch, whose padding rows see no key (eager attention gives them NaN gradients in
    float64), against the same model through numba_flash's float64 numpy reference, with its
    float32 run as the baseline."""
    _, _, padded = _configs()[name]
    implementations = ["numba_flash"] * 3 if padded else ["numba_flash", "eager", "eager"]
    backends = ["numba", "numpy", "numpy"] if padded else ["numba", None, None]
    registered("numba")
    models = _models(name, implementations, torch.float32)
    models[2] = models[2].to(torch.float64)
    ids, mask = _batch(torch.Generator().manual_seed(int(rng.integers(2**31))), padded)
    results = []
    for model, backend in zip(models, backends):
        if backend:
            registered(backend)
        results.append(_step(model, ids, mask))
    got, base, ref = results
    assert_within_rule("logits", got[0].numpy(), base[0].numpy(), ref[0].numpy(), "float32")
    assert got[1].keys() == ref[1].keys() and len(ref[1]) > 10
    for param in ref[1]:
        assert_within_rule(param, got[1][param].numpy(), base[1][param].numpy(),
                           ref[1][param].numpy(), "float32")


@pytest.mark.parametrize("name", MODELS)
def test_greedy_generation_gives_the_references_tokens(registered, rng, name):
    _, reference_impl, padded = _configs()[name]
    registered("numpy")
    ours, reference = _models(name, ["numba_flash", reference_impl], torch.float64)
    ids, mask = _batch(torch.Generator().manual_seed(int(rng.integers(2**31))), padded)
    options = dict(attention_mask=mask, max_new_tokens=32, do_sample=False, min_new_tokens=32)
    got, want = (model.generate(ids, **options) for model in (ours, reference))
    assert got.shape == (2, SEQLEN + 32)
    assert torch.equal(got, want)


def test_a_single_sequence_is_asked_about_packing_once_per_forward(registered, monkeypatch):
    """Batch 1, no padding: transformers' packed-sequence test (a host read) runs once per
    forward, not once per layer, and the model takes the path it took before (the same
    logits); position_ids of two packed sequences still take the varlen path."""
    from transformers import modeling_flash_attention_utils as utils
    from transformers.integrations.flash_attention import flash_attention_forward
    registered("numpy")
    model, = _models("llama-gqa", ["numba_flash"], torch.float64)
    reads, packed_paths = [], []
    ask, prepare = utils._is_packed_sequence, utils._prepare_from_posids

    def asking(position_ids, batch_size):  # (counts the calls that read the values)
        if position_ids is not None and batch_size == 1 and position_ids.shape[-1] > 1:
            reads.append(position_ids)
        return ask(position_ids, batch_size)
    monkeypatch.setattr(utils, "_is_packed_sequence", asking)
    monkeypatch.setattr(utils, "_prepare_from_posids", lambda *args: (
        packed_paths.append(1) or prepare(*args)))
    ids = torch.randint(0, VOCAB, (1, SEQLEN), generator=torch.Generator().manual_seed(1))
    got = model(ids).logits
    assert model.config.num_hidden_layers == 2 and len(reads) == 1 and not packed_paths
    # transformers' wrapper alone (as registered before): it asks in every layer
    transformers.AttentionInterface.register("numba_flash", flash_attention_forward)
    want = model(ids).logits
    assert len(reads) == 1 + model.config.num_hidden_layers
    assert torch.equal(got, want)
    registered("numpy")
    positions = torch.cat([torch.arange(5), torch.arange(SEQLEN - 5)])[None]
    model(ids, position_ids=positions)
    assert len(packed_paths) == model.config.num_hidden_layers


@pytest.mark.parametrize("name", MODELS)
def test_the_dense_path_is_transformers_wrappers_path(registered, monkeypatch, name):
    """Without padding the attention function computes transformers' dense path itself (its
    wrapper is not called) and gives the wrapper's logits bit for bit (causal, GQA, windows,
    softcap, scaling; float64, numpy backend); batch 1 with position_ids likewise; a padding
    mask goes through the wrapper (un-padding: varlen)."""
    registered("numpy")
    model, = _models(name, ["numba_flash"], torch.float64)
    wrapped, wrapper = [], numba_transformers.flash_attention_forward
    monkeypatch.setattr(numba_transformers, "flash_attention_forward",
                        lambda *args, **kwargs: wrapped.append(1) or wrapper(*args, **kwargs))
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (2, SEQLEN), generator=gen)
    got = [model(ids).logits, model(ids[:1], position_ids=torch.arange(SEQLEN)[None]).logits]
    assert not wrapped
    transformers.AttentionInterface.register("numba_flash", wrapper)
    want = [model(ids).logits, model(ids[:1], position_ids=torch.arange(SEQLEN)[None]).logits]
    registered("numpy")
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    _, mask = _batch(gen, padded=True)
    model(ids, attention_mask=mask)
    assert len(wrapped) == model.config.num_hidden_layers


@pytest.mark.parametrize("name", ["llama-gqa", "mistral-window"])
def test_a_model_compiled_with_fullgraph(registered, name):
    """torch.compile(model, fullgraph=True) traces a model whose attention is ours (the dense
    path calls the numba_flash::forward op, no graph break; without an attention_mask, whose
    all-ones test in transformers' flash mask is data-dependent) and gives eager's logits and
    gradients (float64, numpy backend)."""
    registered("numpy")
    eager, compiled = _models(name, ["numba_flash"] * 2, torch.float64)
    ids = torch.randint(0, VOCAB, (2, SEQLEN), generator=torch.Generator().manual_seed(4))

    def step(model, run):
        out = run(ids, labels=ids)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}
    want = step(eager, eager)
    got = step(compiled, torch.compile(compiled, fullgraph=True, backend="aot_eager"))
    assert torch.equal(got[0], want[0])
    assert got[1].keys() == want[1].keys() and all(g is not None for g in want[1].values())
    assert all(torch.allclose(got[1][n], want[1][n], rtol=1e-12, atol=1e-12) for n in want[1])


def test_a_single_sequence_compiled(registered):
    """Batch 1 under torch.compile: the packed-sequence read (data-dependent) breaks the graph
    in our attention function, not in transformers' wrapper (whose frame torch.compile
    recompiles per layer_idx, running eagerly past the recompile limit); logits and gradients
    are eager's, and packed position_ids still take the varlen path (float64, numpy)."""
    from torch._dynamo.utils import counters
    registered("numpy")
    eager, compiled = _models("llama-gqa", ["numba_flash"] * 2, torch.float64)
    ids = torch.randint(0, VOCAB, (1, SEQLEN), generator=torch.Generator().manual_seed(5))
    packed = torch.cat([torch.arange(5), torch.arange(SEQLEN - 5)])[None]
    run = torch.compile(compiled, backend="aot_eager")
    torch._dynamo.reset()
    counters.clear()
    for position_ids in (None, packed):
        results = []
        for model, call in ((eager, eager), (compiled, run)):
            model.zero_grad()
            out = call(ids, labels=ids, position_ids=position_ids, use_cache=False)
            out.loss.backward()
            results.append((out.logits.detach(), {n: p.grad for n, p in
                                                  model.named_parameters()}))
        (want, want_grads), (got, got_grads) = results
        assert torch.equal(got, want)
        assert all(torch.allclose(got_grads[n], want_grads[n], rtol=1e-12, atol=1e-12)
                   for n in want_grads)
        if position_ids is None:
            breaks = list(counters["graph_break"])
            # (every break names our _packed, however torch words it; none is the wrapper's)
            assert breaks and all("_packed" in reason for reason in breaks), breaks


def test_a_single_sequence_under_inference_mode(registered):
    """Inference tensors have no version counter: the packed-sequence answer is not cached
    for them, and the model runs (the same logits as outside inference mode)."""
    registered("numpy")
    model, = _models("llama-gqa", ["numba_flash"], torch.float64)
    ids = torch.randint(0, VOCAB, (1, SEQLEN), generator=torch.Generator().manual_seed(3))
    want = model(ids).logits
    with torch.inference_mode():
        got = model(ids).logits
    assert torch.equal(got, want)


def test_the_flash_functions_refuse_dropout_sinks_and_bad_backends():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="dropout_p must be 0.0: numba_flash has no attention "
                                         "dropout yet"):
        numba_transformers.flash_attn_func(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match="s_aux \\(attention sinks\\) is not supported"):
        numba_transformers.flash_attn_varlen_func(q[0], q[0], q[0], *[torch.tensor(
            [0, 4], dtype=torch.int32)] * 2, 4, 4, s_aux=torch.zeros(2))
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        numba_transformers.register(backend="fast")


def test_importing_numba_flash_does_not_import_transformers():
    code = ("import sys, numba_flash, numba_flash.torch\n"
            "print('transformers' in sys.modules)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, NUMBA_ENABLE_CUDASIM="1"), check=True)
    assert run.stdout.strip() == "False"


REAL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
            num_attention_heads=16, num_key_value_heads=4, head_dim=64,
            max_position_embeddings=8192, attention_dropout=0.0)


def _real_configs():
    return {
        "llama-gqa": (transformers.LlamaConfig(**REAL), "sdpa"),
        "mistral-window": (transformers.MistralConfig(**REAL, sliding_window=1024), "sdpa"),
        "gemma2-softcap": (transformers.Gemma2Config(
            **REAL, sliding_window=1024, attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0, query_pre_attn_scalar=64), "eager"),
        "qwen2": (transformers.Qwen2Config(**REAL), "sdpa"),
    }


@pytest.mark.gpu
@pytest.mark.parametrize("name", MODELS)
def test_a_real_size_model_on_the_gpu(registered, rng, name):
    """4 layers, seq 4096, bfloat16 on the GPU: logits and one training step's gradients by
    the accuracy rule against the float64 model with eager attention (the baseline: the
    bfloat16 model with SDPA, eager for Gemma 2), then greedy generate() of 32 tokens after a
    512-token prompt, in float32, giving SDPA's (eager's) tokens."""
    config, baseline_impl = _real_configs()[name]
    registered("auto")
    torch.manual_seed(int(rng.integers(2**31)))
    models = [transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                            attn_implementation=impl)
              for impl in ("numba_flash", baseline_impl, "eager")]
    for model in models[1:]:
        model.load_state_dict(models[0].state_dict())
    models = [model.to("cuda", dtype) for model, dtype in
              zip(models, (torch.bfloat16, torch.bfloat16, torch.float64))]
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    ids = torch.randint(0, config.vocab_size, (1, 4096), generator=gen).cuda()
    mask = torch.ones_like(ids)
    (got, base, ref) = (_step(model, ids, mask) for model in models)

    def host(x):
        return (x.float() if x.dtype == torch.bfloat16 else x).cpu().numpy()
    assert_within_rule("logits", host(got[0]), host(base[0]), host(ref[0]), "bfloat16")
    for param in ref[1]:
        assert_within_rule(param, host(got[1][param]), host(base[1][param]),
                           host(ref[1][param]), "bfloat16")
    prompt = ids[:, :512]
    options = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False)
    with torch.no_grad():  # (in float32: bfloat16's rounding would make near-ties a coin toss)
        tokens = [model.float().generate(prompt, attention_mask=torch.ones_like(prompt),
                                         **options) for model in models[:2]]
    assert torch.equal(tokens[0], tokens[1])
