"""Shared fixtures: tiny random-initialised models (no downloads), Dynamo isolation.

transformers is imported inside the builders only, so collecting tests that do not use the
Hugging Face models does not import it.
"""

from __future__ import annotations

import os

import torch

# Without a GPU the Triton kernels run in Triton's CPU interpreter. Triton reads the switch when it
# is first imported, and torch's compiler may import it long before tests/methods/pbs/test_pbs_triton.py is
# collected, so it is set here, before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _share_the_cores_between_workers() -> None:
    """Give each pytest-xdist worker its share of the cores. Each worker's torch would otherwise
    start one OpenMP thread per core: on the 2-core CI machine two workers ran four threads that
    spin while they wait, and two real-checkpoint checks side by side took 307 s instead of 102 s.
    The environment variable carries the share to the subprocesses a check starts."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "PYTEST_XDIST_WORKER" in os.environ:
        share = max(1, len(os.sched_getaffinity(0)) // workers)
        os.environ["OMP_NUM_THREADS"] = str(share)
        torch.set_num_threads(share)


_share_the_cores_between_workers()

import pytest  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

VOCAB = 128

# hidden 96 = 6 query heads x head_dim 16 (HF requires hidden % heads == 0); 2 KV heads: group 3
_DECODER_KW = dict(
    hidden_size=96,
    intermediate_size=128,
    num_attention_heads=6,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=1024,
)


def make_tiny(arch: str, layers: int = 2, seed: int = 0):
    """A tiny random-init Hugging Face model with ``attn_implementation="sdpa"``."""
    import transformers as tf

    torch.manual_seed(seed)
    if arch == "llama":
        cfg = tf.LlamaConfig(num_hidden_layers=layers, **_DECODER_KW)
        cls = tf.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(num_hidden_layers=layers, **_DECODER_KW)
        cls = tf.Qwen2ForCausalLM
    elif arch == "mistral":
        cfg = tf.MistralConfig(num_hidden_layers=layers, sliding_window=None, **_DECODER_KW)
        cls = tf.MistralForCausalLM
    elif arch == "gpt2":
        cfg = tf.GPT2Config(
            n_embd=64, n_layer=layers, n_head=4, vocab_size=VOCAB, n_positions=1024, bos_token_id=0, eos_token_id=0
        )
        cls = tf.GPT2LMHeadModel
    elif arch == "bert":
        cfg = tf.BertConfig(
            hidden_size=64,
            num_hidden_layers=layers,
            num_attention_heads=4,
            intermediate_size=128,
            vocab_size=VOCAB,
            max_position_embeddings=512,
        )
        cls = tf.BertModel
    else:  # pragma: no cover
        raise ValueError(arch)
    cfg._attn_implementation = "sdpa"
    model = cls(cfg)
    if getattr(model.config, "_attn_implementation", "sdpa") != "sdpa":  # pragma: no cover
        model.config._attn_implementation = "sdpa"
    return model.eval()


# --------------------------------------------------------------------------- model families
# Tiny random configs of transformers decoder families (tests/test_families.py). Each one sets what
# makes its family itself: sliding-window, alternating or chunked layers (a window of WINDOW tokens,
# well inside the tests' prompts), head_dim where the default is 128+, in-vocabulary token ids.

WINDOW = 32
_TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
_ALTERNATING = ("sliding_attention", "full_attention")  # layer_types, repeated over the layers
_GEMMA = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW, layer_types=_ALTERNATING)

# name: (transformers config class, settings over _DECODER_KW, has windowed or chunked layers)
FAMILIES = {
    "llama": ("LlamaConfig", {}, False),
    "gemma2": ("Gemma2Config", _GEMMA, True),
    "gemma3_text": ("Gemma3TextConfig", _GEMMA, True),
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW), True),
    # layers from max_window_layers on slide: layer 0 full, the rest sliding
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1), True),
    "cohere2": ("Cohere2Config", dict(sliding_window=WINDOW, layer_types=_ALTERNATING), True),
    # RoPE layers attend within chunks, every 2nd layer (NoPE) to everything; 2 experts keep it small
    "llama4_text": (
        "Llama4TextConfig",
        dict(
            head_dim=16,
            intermediate_size_mlp=128,
            num_local_experts=2,
            attention_chunk_size=WINDOW,
            no_rope_layer_interval=2,
        ),
        True,
    ),
    "phi3": ("Phi3Config", dict(original_max_position_embeddings=1024), False),
    "gpt_neox": ("GPTNeoXConfig", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=None), False),
    "olmo2": ("Olmo2Config", {}, False),
    "qwen3": ("Qwen3Config", dict(head_dim=16), False),
    "starcoder2": ("Starcoder2Config", dict(sliding_window=None), False),
}


def family_config(name: str, layers: int = 2):
    """The tiny config of a family of FAMILIES; skips the test when transformers lacks the family."""
    import transformers as tf

    cls_name, extra, _ = FAMILIES[name]
    cls = getattr(tf, cls_name, None)
    if cls is None:
        pytest.skip(f"transformers {tf.__version__} has no {cls_name}")
    kw = {**_DECODER_KW, **_TOKEN_IDS, **extra, "num_hidden_layers": layers}
    if kw.get("num_key_value_heads") is None:
        kw.pop("num_key_value_heads", None)  # a family without GQA settings (gpt_neox)
    if isinstance(kw.get("layer_types"), tuple):
        pattern = kw["layer_types"]
        kw["layer_types"] = [pattern[i % len(pattern)] for i in range(layers)]
    return cls(**kw)


def make_family(name: str, layers: int = 2, seed: int = 0, attn_implementation: str = "sdpa"):
    """A tiny random-init causal LM of a family of FAMILIES, in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(family_config(name, layers), attn_implementation=attn_implementation).eval()


class AttentionBlock(nn.Module):
    """A user attention module calling F.scaled_dot_product_attention directly (native GQA)."""

    def __init__(self, dim=48, heads=6, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, heads * self.hd)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.hd)
        self.o = nn.Linear(heads * self.hd, dim)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.hd).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return x + self.o(a.transpose(1, 2).reshape(b, n, -1))


class PlainAttention(nn.Module):
    """A stack of user attention blocks: tags ``blocks.0``, ``blocks.1``, ..."""

    def __init__(self, dim=48, heads=6, kv_heads=2, layers=2, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(AttentionBlock(dim, heads, kv_heads) for _ in range(layers))

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return x


@pytest.fixture
def tiny():
    """``tiny(arch, layers=2, seed=0)`` builds a tiny HF model (llama, qwen2, mistral, gpt2, bert)."""
    pytest.importorskip("transformers")
    return make_tiny


@pytest.fixture
def plain_attention():
    return PlainAttention


@pytest.fixture
def fresh_dynamo():
    """Empty Dynamo caches before and after the test (opt in with usefixtures: sparseflow.compile
    gives every model its own cache, so this only keeps memory flat across many compiles)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def poisoned(monkeypatch):
    """Inside ``poisoned(fn)``, every tensor ``torch.empty`` allocates starts as NaN (floats), -7
    (ints) or True (bools): an element a kernel leaves unwritten shows up in the result."""

    real_empty = torch.empty

    def empty(*size, dtype=None, device=None, **kw):
        t = real_empty(*size, dtype=dtype, device=device, **kw)
        if t.dtype.is_floating_point:
            return t.fill_(float("nan"))
        return t.fill_(True) if t.dtype == torch.bool else t.fill_(-7)

    def call(fn, *a, **kw):
        with monkeypatch.context() as m:
            m.setattr(torch, "empty", empty)
            return fn(*a, **kw)

    return call


# --------------------------------------------------------------------------- the order files run in


def pytest_configure(config):
    # pytest-xdist's --dist loadfile hands out whole files, re-sorted by their number of tests
    # unless told not to; the order of pytest_collection_modifyitems below is kept instead
    if getattr(config.option, "loadscopereorder", None) is not None:
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """Files holding a ``slow`` test first (minutes each, in few tests), then the others by their
    number of tests, most first (xdist's own order). Sorted by count alone, the slow files came
    last and one worker ran them while the other idled: on the 2-core CI machine the suite ended
    minutes after most of it."""
    per_file = {}
    for item in items:
        per_file.setdefault(item.nodeid.split("::")[0], []).append(item)
    slow = {f for f, its in per_file.items() if any(i.get_closest_marker("slow") for i in its)}
    order = sorted(per_file, key=lambda f: (f not in slow, -len(per_file[f]) if f not in slow else 0))
    items[:] = [item for f in order for item in per_file[f]]
