"""sparseflow.eval.niah and ``sparseflow eval --task niah``: passkey prompts, accuracy, the CLI path."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from sparseflow import convert as convert_mod  # noqa: E402
from sparseflow.eval import niah  # noqa: E402
from sparseflow.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    from test_convert import _char_tokenizer

    return _char_tokenizer()


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tok):
    import conftest

    path = tmp_path_factory.mktemp("tiny_llama_niah")
    conftest.make_tiny("llama", layers=2).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _enc(tok, text):
    return tok(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("n,depth", [(300, 0.0), (300, 0.5), (777, 0.3), (777, 1.0)])
def test_prompt_length_and_needle_depth(tok, n, depth):
    s = niah.build_sample(tok, n, depth, seed=2)
    ids = s.ids[0].tolist()
    assert len(ids) == n
    needle = _enc(tok, niah._needle("", s.answer))
    start = s.needle_starts[""]
    assert ids[start : start + len(needle)] == needle
    lo, hi = s.filler_span
    filler_len = hi - lo - len(needle)
    assert abs((start - lo) - depth * filler_len) <= niah.MAX_PIECE  # within one filler sentence (piece)
    assert ids[hi:] == _enc(tok, niah._question(""))


_TEMPLATE = "{% for m in messages %}<u>{{ m['content'] }}</u>{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"


@pytest.fixture(scope="module")
def chat_tok():
    from test_convert import _char_tokenizer

    t = _char_tokenizer()
    t.chat_template = _TEMPLATE
    return t


@pytest.mark.parametrize("n,depth,keys", [(400, 0.0, 1), (613, 0.5, 1), (900, 0.7, 3)])
def test_chat_prompt_wraps_the_text_in_the_template(chat_tok, n, depth, keys):
    s = niah.build_sample(chat_tok, n, depth, keys=keys, seed=5, prompt="chat")
    ids = s.ids[0].tolist()
    assert len(ids) == n
    assert ids[: s.filler_span[0]] == _enc(chat_tok, "<u>" + niah._INTRO)
    question, answer_start = niah._chat_question(s.asked)
    assert ids[s.filler_span[1] :] == _enc(chat_tok, question + "</u><a>" + answer_start)
    needle = _enc(chat_tok, niah._needle(s.asked, s.answer))
    assert ids[s.needle_starts[s.asked] : s.needle_starts[s.asked] + len(needle)] == needle
    # the same keys as the plain prompt of the same seed (the filler differs: the frame's length does)
    plain = niah.build_sample(chat_tok, n, depth, keys=keys, seed=5, prompt="plain")
    assert plain.answer == s.answer and plain.keys == s.keys and not torch.equal(plain.ids, s.ids)


def test_prompt_format_auto_follows_the_template(tok, chat_tok):
    assert niah.prompt_format(chat_tok, "auto") == "chat" and niah.prompt_format(tok, "auto") == "plain"
    assert niah.prompt_format(chat_tok, "plain") == "plain"
    assert torch.equal(
        niah.build_sample(chat_tok, 500, 0.5, prompt="auto").ids,
        niah.build_sample(chat_tok, 500, 0.5, prompt="chat").ids,
    )
    with pytest.raises(ValueError, match="--prompt chat needs a tokenizer with a chat template"):
        niah.build_sample(tok, 500, 0.5, prompt="chat")
    with pytest.raises(ValueError, match="--prompt must be one of auto, chat, plain, got 'xml'"):
        niah.prompt_format(tok, "xml")


def test_multi_key_question_asks_a_present_key(tok):
    s = niah.build_sample(tok, 900, 0.5, keys=3, seed=1)
    ids = s.ids[0].tolist()
    assert len(ids) == 900 and len(s.keys) == 3 and len(set(s.keys.values())) == 3
    assert s.asked in s.keys and s.answer == s.keys[s.asked]
    for name, key in s.keys.items():
        needle = _enc(tok, niah._needle(name, key))
        assert ids[s.needle_starts[name] : s.needle_starts[name] + len(needle)] == needle
    assert ids[s.filler_span[1] :] == _enc(tok, niah._question(s.asked))
    # the asked key at its depth: filler before it, needles before it excluded
    lo, hi = s.filler_span
    before = sum(
        len(_enc(tok, niah._needle(m, k))) for m, k in s.keys.items() if s.needle_starts[m] < s.needle_starts[s.asked]
    )
    filler_len = hi - lo - sum(len(_enc(tok, niah._needle(m, k))) for m, k in s.keys.items())
    assert abs(s.needle_starts[s.asked] - lo - before - 0.5 * filler_len) <= niah.MAX_PIECE


def test_prompts_are_deterministic(tok):
    a, b = niah.build_sample(tok, 400, 0.5, seed=3), niah.build_sample(tok, 400, 0.5, seed=3)
    assert torch.equal(a.ids, b.ids) and a.answer == b.answer
    c = niah.build_sample(tok, 400, 0.5, seed=4)
    assert not torch.equal(a.ids, c.ids)


def test_prompt_errors(tok):
    with pytest.raises(ValueError, match="--tokens 50 is too short"):
        niah.build_sample(tok, 50, 0.5)
    with pytest.raises(ValueError, match="depth must be in"):
        niah.build_sample(tok, 400, 1.5)
    with pytest.raises(ValueError, match=r"--depths must be a comma list"):
        niah.parse_depths("0.1,x")


def test_accuracy_with_a_stub_answer(tok, tiny):
    from sparseflow.convert import build_plan

    model = tiny("llama", layers=1)
    plan = build_plan(model.config, "pbs", backend="reference")
    depths = [0.2, 0.8]
    answers = [niah.build_sample(tok, 300, d, seed=s).answer for d in depths for s in range(2)]

    def answering(text):
        return lambda model, ids, n: _enc(tok, text)

    wrong = niah.run_niah(model, tok, [plan], n_tokens=300, depths=depths, samples=2, generate=answering("00000"))
    assert [r["name"] for r in wrong] == ["dense", "pbs"]
    assert all(r["accuracy"] == 0.0 and r["accuracy_per_depth"] == {"0.2": 0.0, "0.8": 0.0} for r in wrong)
    right = niah.run_niah(
        model, tok, [plan], n_tokens=300, depths=depths, samples=2, generate=answering(" ".join(answers))
    )
    assert all(r["accuracy"] == 1.0 and r["accuracy_per_depth"] == {"0.2": 1.0, "0.8": 1.0} for r in right)
    table = niah.format_niah(right, depths)
    assert "d=0.2" in table and "pbs" in table.splitlines()[-1]


def test_greedy_prefill_runs_the_plan(tok, tiny):
    from sparseflow.convert import build_plan

    model = tiny("llama", layers=2)
    plan = build_plan(model.config, "pbs", backend="reference")
    res = niah.run_niah(model, tok, [plan], n_tokens=300, depths=[0.5], samples=1, max_new_tokens=3)
    dense, pbs = res
    assert dense["samples"][0]["sparse_calls"] == 0
    assert pbs["samples"][0]["sparse_calls"] == 2  # every layer's prefill went through the sparse op
    assert dense["needle_kept"] is None and dense["samples"][0]["needle_kept"] is None
    assert 0.0 <= pbs["samples"][0]["needle_kept_min_layer"] <= pbs["needle_kept"] <= 1.0
    table = niah.format_niah(res, [0.5]).splitlines()
    assert table[0].split()[-1] == "needle" and table[2].split()[-1] == "-"
    assert table[3].split()[-1] == f"{pbs['needle_kept']:.2f}"
    assert len(tok(pbs["samples"][0]["generated"].replace(" ", ""), add_special_tokens=False).input_ids) <= 3
    assert model.config._attn_implementation == "sdpa"


def _pbs_selection(n, drop_blocks, heads=2, bs=16):
    """A PBS selection over identity-permuted keys: every block attended, except ``drop_blocks``
    for head 0 of the last query block."""
    from sparseflow.selection import Selection

    nb = -(-n // bs)
    bm = torch.ones(1, heads, nb, nb, dtype=torch.bool)
    for kb in drop_blocks:
        bm[0, 0, -1, kb] = False
    return Selection(
        method="pbs",
        density=torch.ones(1, heads),
        block_size=bs,
        is_causal=True,
        num_keys=n,
        block_mask=bm,
        permutation=torch.arange(n)[None, None],
    )


def test_needle_recall_counts_the_needle_tokens_the_last_position_sees(tok):
    from types import SimpleNamespace

    s = niah.build_sample(tok, 300, 0.5, seed=2)
    start, length = s.needle_starts[""], s.needle_lengths[""]
    assert length == len(_enc(tok, niah._needle("", s.answer)))
    first, last = start // 16, (start + length - 1) // 16

    def call(sel, n=300):
        return SimpleNamespace(selection=sel, q_shape=(1, 2, n, 8))

    hidden = call(_pbs_selection(300, range(first, last + 1)))  # head 0 loses the whole needle
    half = call(_pbs_selection(300, [first]))  # head 0 loses the needle's first block only
    seen = call(_pbs_selection(300, []))
    decode = SimpleNamespace(selection=None, q_shape=(1, 2, 1, 8))
    assert niah.needle_recall([hidden, seen, decode], s) == (0.75, 0.5)
    in_first = (first + 1) * 16 - start
    mean, low = niah.needle_recall([half], s)
    assert mean == low == pytest.approx(0.5 * (length - in_first) / length + 0.5)
    assert niah.needle_recall([decode], s) == (None, None)


def test_cli_niah_end_to_end(folder, tmp_path, capsys):
    out = tmp_path / "niah.json"
    rc = main(
        [
            "eval",
            str(folder),
            "--task",
            "niah",
            "--method",
            "pbs",
            "--backend",
            "reference",
            "--tokens",
            "300",
            "--depths",
            "0.2,0.8",
            "--samples",
            "1",
            "--max-new-tokens",
            "2",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "d=0.2" in printed and "d=0.8" in printed and "\npbs " in printed
    data = json.loads(out.read_text())
    assert data["task"] == "niah" and data["depths"] == [0.2, 0.8] and data["rope_scaling"] is None
    assert data["prompt"] == "plain"  # auto: the folder's tokenizer has no chat template
    assert [r["name"] for r in data["results"]] == ["dense", "pbs"]
    assert set(data["results"][1]["accuracy_per_depth"]) == {"0.2", "0.8"}


def test_cli_prompt_chat_without_a_template_is_one_line(folder, capsys):
    argv = ["eval", str(folder), "--task", "niah", "--method", "pbs", "--tokens", "300", "--prompt", "chat"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("sparseflow eval: error: --prompt chat needs a tokenizer with a chat template"), err


def test_cli_rope_scaling_recorded(folder, tmp_path, capsys):
    out = tmp_path / "fid.json"
    rc = main(
        [
            "eval",
            str(folder),
            "--method",
            "pbs",
            "--backend",
            "reference",
            "--tokens",
            "200",
            "--eval-positions",
            "20",
            "--rope-scaling",
            "yarn:2",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    assert "RoPE scaling yarn:2: yarn x2 over 1024" in capsys.readouterr().err
    info = json.loads(out.read_text())["rope_scaling"]
    assert info["rope_type"] == "yarn" and info["factor"] == 2.0 and info["original_max_position_embeddings"] == 1024
    out2 = tmp_path / "niah.json"
    assert (
        main(
            [
                "eval",
                str(folder),
                "--task",
                "niah",
                "--method",
                "pbs",
                "--backend",
                "reference",
                "--tokens",
                "300",
                "--depths",
                "0.5",
                "--samples",
                "1",
                "--max-new-tokens",
                "1",
                "--rope-scaling",
                "linear:2",
                "--json",
                str(out2),
            ]
        )
        == 0
    )
    assert json.loads(out2.read_text())["rope_scaling"]["rope_type"] == "linear"


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--task", "needle"], "--task must be one of fidelity, niah"),
        (["--task", "niah", "--depths", "0.5,1.2"], "--depths must be a comma list"),
        (["--task", "niah", "--depths", "a"], "--depths must be a comma list"),
        (["--task", "niah", "--keys", "0"], "--keys must be in [1, 10]"),
        (["--depths", "0.5"], "--depths/--samples/--keys/--prompt are for --task niah"),
        (["--prompt", "chat"], "--depths/--samples/--keys/--prompt are for --task niah"),
        (["--task", "niah", "--prompt", "xml"], "--prompt must be one of auto, chat, plain"),
        (["--rope-scaling", "yarn:fast"], "--rope-scaling: rope_scaling must be"),
        (["--rope-scaling", "rope:2"], "yarn:auto:N"),
    ],
)
def test_cli_bad_arguments_one_line_before_loading(folder, capsys, monkeypatch, extra, needle):
    def refuse(*a, **k):
        raise AssertionError("the weights were loaded before the arguments were checked")

    monkeypatch.setattr(convert_mod, "load_source", refuse)
    assert main(["eval", str(folder), "--method", "pbs"] + extra) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("sparseflow eval: error: ") and needle in err, err


def test_is_correct():
    assert niah.is_correct(" 73915. Remember", "73915") and niah.is_correct("7 3 9 1 5", "73915")
    assert not niah.is_correct(" 73914", "73915") and not niah.is_correct("", "73915")


def test_generate_greedy_matches_transformers_generate(tiny):
    model = tiny("llama", layers=1)
    ids = torch.randint(0, 128, (1, 50), generator=torch.Generator().manual_seed(0))
    ref = model.generate(ids, max_new_tokens=5, do_sample=False)[0, 50:].tolist()
    assert niah.generate_greedy(model, ids, 5) == ref
