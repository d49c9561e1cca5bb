"""``sparseflow convert`` / ``sparseflow eval`` and the transformers integration (sparseflow.hf):
a tiny random-init Llama saved with save_pretrained is converted, reloaded with the "sparseflow"
attention, checked against the original, and evaluated; the real SmolLM2 GGUF end to end (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sparseflow
from sparseflow.checkpoints import SMOLLM2_PACKAGE_HINT, smollm2_gguf

pytest.importorskip("transformers")

from sparseflow import hf  # noqa: E402
from sparseflow.cli import main  # noqa: E402
from sparseflow.convert import ConversionError, convert, resolve_source  # noqa: E402

EXACT = {
    "pbs": {"block_size": 16, "segment_size": 32, "threshold": 1.0},
    "pisa": {"block_size": 16, "top_k": 64},
    "bsa": {"block_size": 16, "top_k": 64},
}
N = 200  # tokens: 12.5 blocks of 16, 6 complete PBS segments of 32


def _char_tokenizer():
    """A character-level fast tokenizer over ASCII (ids 0..127 = the tiny models' vocab)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(i): i for i in range(128)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="\x00"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="\x00", pad_token="\x01", eos_token="\x02")


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """A tiny Llama (2 layers, 6 query / 2 KV heads) saved with save_pretrained + a tokenizer."""
    import conftest

    folder = tmp_path_factory.mktemp("tiny_llama")
    model = conftest.make_tiny("llama", layers=2)
    model.save_pretrained(folder)
    _char_tokenizer().save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def ids():
    torch.manual_seed(1)
    return torch.randint(3, 128, (1, N))


def _logits(model, ids, **kw):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False, **kw).logits


@pytest.fixture(scope="module")
def converted_pbs(src, tmp_path_factory):
    folder, _ = src
    out = tmp_path_factory.mktemp("conv") / "pbs"
    convert(folder, out, "pbs", config=EXACT["pbs"])
    return out


# --------------------------------------------------------------------------- convert + reload


def test_converted_folder_records_the_plan(converted_pbs):
    data = json.loads((converted_pbs / "config.json").read_text())
    assert data["attn_implementation"] == "sparseflow"
    plan = data["sparseflow"]
    assert plan["method"] == "pbs" and plan["config"]["threshold"] == 1.0
    assert plan["num_layers"] == 2 and plan["dense_layers"] == [] and plan["format"] == hf.PLAN_FORMAT
    assert (converted_pbs / "tokenizer.json").is_file() and (converted_pbs / "model.safetensors").is_file()
    # nothing but the output in its parent: the temp folder was renamed into place
    assert sorted(p.name for p in converted_pbs.parent.iterdir()) == ["pbs"]


@pytest.mark.parametrize("method", ["pbs", "pisa", "bsa"])
def test_exact_mode_reproduces_the_original(src, ids, tmp_path, method):
    folder, original = src
    out = convert(folder, tmp_path / method, method, config=EXACT[method])
    hf.register()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config._attn_implementation == "sparseflow"
    with sparseflow.capture() as cap:
        got = _logits(model, ids)
    assert [c.tag for c in cap.calls] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert all(c.sparse and c.method == method for c in cap.calls), [(c.method, c.reason) for c in cap.calls]
    torch.testing.assert_close(got, _logits(original, ids), atol=2e-5, rtol=1e-4)


def test_sparse_mode_is_sparse_and_padding_is_honoured(src, tmp_path):
    folder, original = src
    out = convert(folder, tmp_path / "sparse", "pbs", config={"block_size": 16, "segment_size": 32, "threshold": 0.3})
    model = hf.from_pretrained(out)
    torch.manual_seed(2)
    x = torch.randint(3, 128, (2, 256))
    mask = torch.ones(2, 256, dtype=torch.long)
    mask[1, :40] = 0  # left padding of the second row
    with sparseflow.capture() as cap:
        got = _logits(model, x, attention_mask=mask)
    assert all(c.sparse for c in cap.calls), [c.reason for c in cap.calls]
    assert 0.0 < cap.mean_density() < 0.95
    assert torch.isfinite(got[0]).all() and torch.isfinite(got[1, 40:]).all()
    ref = _logits(original, x, attention_mask=mask)
    assert (got - ref)[0].abs().max() > 0  # really sparse: not the dense result
    # exact mode with padding equals the original on the valid positions
    exact_pad = convert(folder, tmp_path / "exact", "pbs", config=EXACT["pbs"])
    exact = hf.from_pretrained(exact_pad)
    torch.testing.assert_close(_logits(exact, x, attention_mask=mask)[1, 40:], ref[1, 40:], atol=2e-5, rtol=1e-4)


def test_dense_layers_and_sdpa_reload(src, ids, tmp_path):
    folder, original = src
    out = convert(folder, tmp_path / "dl", "bsa", dense_layers="1", config={"block_size": 16, "top_k": 3})
    model = hf.from_pretrained(out)
    with sparseflow.capture() as cap:
        _logits(model, ids)
    assert [(c.method, c.sparse) for c in cap.calls] == [("bsa", True), ("dense", False)]
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa").eval()
    with sparseflow.capture() as cap:
        got = _logits(dense, ids)
    assert cap.calls == []
    torch.testing.assert_close(got, _logits(original, ids), atol=1e-5, rtol=1e-5)


def test_sparseflow_compile_accepts_a_converted_model(converted_pbs, src, ids):
    _, original = src
    model = hf.from_pretrained(converted_pbs)
    sparseflow.compile(model, method="pbs", inner_backend="eager")
    with sparseflow.capture() as cap:
        got = _logits(model, ids)
    assert len(cap.calls) == 2 and all(c.sparse for c in cap.calls)
    assert sparseflow.report(model).num_rewritten == 0  # nothing left as bare SDPA
    torch.testing.assert_close(got, _logits(original, ids), atol=2e-5, rtol=1e-4)


def test_generate_still_works(converted_pbs, src):
    _, original = src
    model = hf.from_pretrained(converted_pbs)
    prompt = torch.randint(3, 128, (1, 70))
    a = model.generate(prompt, max_new_tokens=4, do_sample=False)
    b = original.generate(prompt, max_new_tokens=4, do_sample=False)
    assert torch.equal(a, b)


# --------------------------------------------------------------------------- errors


def test_missing_and_wrong_sources(tmp_path, src):
    folder, _ = src
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_source(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="missing config.json and weights"):
        resolve_source(tmp_path / "empty")
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="missing weights"):
        convert(tmp_path / "noweights", tmp_path / "out", "pbs")
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(ConversionError, match="not a .gguf"):
        resolve_source(tmp_path / "w.bin")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "body,words",
    [
        (b"GGUF" + bytes(range(256)) * 8, "corrupt or truncated GGUF file"),
        (b"GGUF", "corrupt or truncated GGUF file"),
        (b"PK\x03\x04not a gguf", "is not a GGUF file: it starts with b'PK"),
    ],
    ids=["magic-then-garbage", "magic-only", "zip-named-gguf"],
)
def test_corrupt_gguf_is_named_as_such(tmp_path, body, words):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(body)
    with pytest.raises(ConversionError, match=words):
        convert(bad, tmp_path / "out", "pbs")
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture(tmp_path):
    import conftest

    conftest.make_tiny("bert").save_pretrained(tmp_path / "bert")
    with pytest.raises(
        ConversionError, match=r"unsupported architecture: model_type='bert' \(BertLMHeadModel\): it is an encoder"
    ):
        convert(tmp_path / "bert", tmp_path / "out", "pbs")
    assert not (tmp_path / "out").exists()


def test_bad_recipes_configs_and_layers(src, tmp_path):
    folder, _ = src
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match="unknown recipe 'nope'.*smollm2"):
        convert(folder, out, "pbs", recipe="nope")
    with pytest.raises(ConversionError, match="expects head_dim=64, but the model has 16"):
        convert(folder, out, "pbs", recipe="smollm2")
    with pytest.raises(ConversionError, match="threshold must be in"):
        convert(folder, out, "pbs", config={"threshold": 2.0})
    with pytest.raises(ConversionError, match="unknown fields"):
        convert(folder, out, "pisa", config='{"threshold": 0.5}')
    with pytest.raises(ConversionError, match="out of range"):
        convert(folder, out, "pbs", dense_layers=[5])
    with pytest.raises(ConversionError, match="method must be one of"):
        convert(folder, out, "dense")
    assert not out.exists()


def test_existing_output_and_no_half_written_folder(src, tmp_path, monkeypatch):
    folder, _ = src
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        convert(folder, out, "pbs", config=EXACT["pbs"])
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(hf.Plan, "from_dict", classmethod(lambda cls, d: boom()))
    with pytest.raises(RuntimeError, match="disk full"):
        convert(folder, out, "pbs", config=EXACT["pbs"], overwrite=True)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp folder left behind
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]  # the old output untouched
    convert(folder, out, "pbs", config=EXACT["pbs"], overwrite=True)
    assert (out / "config.json").is_file() and not (out / "keep.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# --------------------------------------------------------------------------- command line


def test_cli_convert_and_errors(src, tmp_path, capsys):
    folder, _ = src
    out = tmp_path / "cli"
    rc = main(
        [
            "convert",
            str(folder),
            "--method",
            "pisa",
            "--out",
            str(out),
            "--config",
            json.dumps(EXACT["pisa"]),
            "--dense-layers",
            "0",
        ]
    )
    assert rc == 0
    err = capsys.readouterr().err
    assert "[1/4]" in err and "[4/4]" in err
    plan = json.loads((out / "config.json").read_text())["sparseflow"]
    assert plan["method"] == "pisa" and plan["dense_layers"] == [0]
    assert main(["convert", str(tmp_path / "missing"), "--method", "pbs", "--out", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["convert", str(folder), "--method", "pbs", "--recipe", "bogus", "--out", str(tmp_path / "o")]) == 2
    assert "unknown recipe" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_python_m_sparseflow_convert_error(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sparseflow",
            "convert",
            str(tmp_path / "missing"),
            "--method",
            "pbs",
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def _check_eval_json(path: Path, methods, layers: int, heads: int, tokens: int):
    data = json.loads(path.read_text())
    assert data["tokens"] == tokens and data["text"] == "pydoc_topics"
    assert [r["method"] for r in data["results"]] == list(methods)
    for r in data["results"]:
        for key in (
            "mean_kl",
            "p99_kl",
            "top1_agreement",
            "ppl_dense",
            "ppl_sparse",
            "ppl_delta",
            "density",
            "positions",
            "density_per_layer",
            "density_per_layer_head",
            "plan",
            "sparse_calls",
            "dense_calls",
        ):
            assert key in r, key
        assert len(r["density_per_layer"]) == layers
        assert all(len(row) == heads for row in r["density_per_layer_head"])
        assert 0.0 < r["density"] <= 1.0 and r["mean_kl"] >= 0.0 and 0.0 <= r["top1_agreement"] <= 1.0
    return data


def test_cli_eval_converted_and_plain(converted_pbs, src, tmp_path, capsys):
    out = tmp_path / "ev.json"
    assert main(["eval", str(converted_pbs), "--tokens", "256", "--eval-positions", "64", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "mean KL" in text and "density per layer" in text
    data = _check_eval_json(out, ["pbs"], layers=2, heads=6, tokens=256)
    r = data["results"][0]
    assert r["mean_kl"] < 1e-8 and r["top1_agreement"] == 1.0  # exact mode
    import torch

    assert data["device"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    folder, _ = src
    out2 = tmp_path / "ev2.json"
    rc = main(
        [
            "eval",
            str(folder),
            "--method",
            "pbs,bsa",
            "--tokens",
            "256",
            "--eval-positions",
            "64",
            "--json",
            str(out2),
            "--plots",
            str(tmp_path / "plots"),
        ]
    )
    assert rc == 0
    capsys.readouterr()
    data = _check_eval_json(out2, ["pbs", "bsa"], layers=2, heads=6, tokens=256)
    assert data["results"][1]["density"] <= 1.0
    assert main(["eval", str(folder), "--tokens", "256"]) == 2
    assert "not a converted model" in capsys.readouterr().err


def _is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000


def test_cli_eval_sweep_no_permute_and_plots(src, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    folder, _ = src
    out, plots = tmp_path / "sweep.json", tmp_path / "plots"
    cfg = json.dumps({"block_size": 16, "segment_size": 32})
    rc = main(
        [
            "eval",
            str(folder),
            "--method",
            "pbs",
            "--config",
            cfg,
            "--tokens",
            "256",
            "--eval-positions",
            "64",
            "--sweep",
            "threshold=0.5,0.95",
            "--no-permute",
            "--json",
            str(out),
            "--plots",
            str(plots),
            "--map-layer",
            "1",
            "--map-head",
            "4",
            "--cache",
            str(tmp_path / "cache"),
        ]
    )
    assert rc == 0, capsys.readouterr().err
    capsys.readouterr()
    data = _check_eval_json(out, ["pbs"] * 4, layers=2, heads=6, tokens=256)
    got = [(r["config"]["threshold"], r["config"]["permute"]) for r in data["results"]]
    assert got == [(0.5, True), (0.95, True), (0.5, False), (0.95, False)]
    pts = data["sweep"]["points"]
    assert data["sweep"]["field"] == "threshold" and len(pts) == 4
    assert [p["series"] for p in pts] == ["pbs", "pbs", "pbs (no permute)", "pbs (no permute)"]
    for p, r in zip(pts, data["results"]):
        assert p["density"] == r["density"] and p["mean_kl"] == r["mean_kl"] and p["top1"] == r["top1_agreement"]
    # a lower threshold keeps fewer blocks, with or without permutation
    assert pts[0]["density"] < pts[1]["density"] and pts[2]["density"] < pts[3]["density"]
    for name in (
        "sweep_kl_vs_density.png",
        "sweep_top1_vs_density.png",
        "density_pbs_threshold0.5.png",
        "blockmap_pbs_threshold0.95_no-permute.png",
    ):
        assert _is_png(plots / name), name
    assert len(list((tmp_path / "cache").glob("dense_logits_*.pt"))) == 1  # dense pass cached once


def test_cli_eval_sweep_errors(src, tmp_path, capsys):
    folder, _ = src
    base = ["eval", str(folder), "--tokens", "128", "--eval-positions", "32"]
    cases = [
        (["--method", "pbs", "--sweep", "top_k=4,8"], "sweep field 'top_k' is not a pbs setting"),
        (["--method", "bsa", "--sweep", "top_k=4,x"], "must be a int"),
        (["--method", "bsa", "--sweep", "top_k"], "field=v1,v2"),
        (["--method", "bsa", "--sweep", "top_k=1"], "top_k must be >="),
        (["--method", "bsa", "--no-permute"], "include pbs in --method"),
        (["--method", "pisa", "--sweep", "top_k=4", "--no-permute"], "--no-permute compares PBS"),
        (
            ["--method", "pbs", "--text", "pydoc_topics", "--map-layer", "7", "--plots", str(tmp_path / "p")],
            "--map-layer must be in [0, 1]",
        ),
    ]
    for extra, match in cases:
        if "--plots" in extra:
            pytest.importorskip("matplotlib")
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err
        assert match in err, (extra, err)


def test_cli_eval_recall_diagnostic(src, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    folder, _ = src
    out, plots = tmp_path / "recall.json", tmp_path / "plots"
    rc = main(["eval", str(folder), "--recall", "--tokens", "640", "--json", str(out), "--plots", str(plots)])
    assert rc == 0, capsys.readouterr().err
    text = capsys.readouterr().out
    assert "Recall@K" in text and "flat_lse" in text
    data = json.loads(out.read_text())
    assert data["top_k"] == 8 and data["block_size"] == 64 and data["q_start"] == 512 and len(data["layers"]) == 2
    for s in ("pisa_lse", "pisa_mean", "pisa_mean_var", "bsa", "flat_lse"):
        m = data["mean"][s]
        assert (
            0.0 < m["recall_free"] <= 1.0 and 0.0 < m["retained_mass"] <= data["mean"]["oracle"]["retained_mass"] + 1e-9
        )
    assert _is_png(plots / "recall_mean.png") and _is_png(plots / "recall_per_layer.png")
    assert main(["eval", str(folder), "--recall", "--recall-k", "3", "--tokens", "640"]) == 2
    assert "--recall-k must be >= 4" in capsys.readouterr().err
    assert (
        main(["eval", str(folder), "--recall", "--method", "pbs", "--sweep", "threshold=0.9", "--tokens", "640"]) == 2
    )
    assert "takes no --sweep" in capsys.readouterr().err


def test_cli_eval_recall_selectors_with_beams(src, tmp_path, capsys):
    folder, _ = src
    out = tmp_path / "recall.json"
    rc = main(
        [
            "eval",
            str(folder),
            "--recall",
            "--tokens",
            "640",
            "--json",
            str(out),
            "--recall-selectors",
            "pisa_lse,pisa_lse_beam2,flat_lse",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    text = capsys.readouterr().out
    assert "pisa_lse_beam2" in text and "bsa" not in text
    data = json.loads(out.read_text())
    assert data["selectors"] == ["pisa_lse", "pisa_lse_beam2", "flat_lse"]
    assert set(data["mean"]) == {"pisa_lse", "pisa_lse_beam2", "flat_lse", "oracle"}
    assert main(["eval", str(folder), "--recall", "--tokens", "640", "--recall-selectors", "pisa_lse_beam0"]) == 2
    assert "--recall-selectors: selector must be one of" in capsys.readouterr().err
    assert main(["eval", str(folder), "--method", "pisa", "--tokens", "640", "--recall-selectors", "pisa_lse"]) == 2
    assert "pass --recall too" in capsys.readouterr().err


def test_cli_eval_plots_without_matplotlib_fails_first(src, tmp_path, capsys, monkeypatch):
    folder, _ = src
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    rc = main(["eval", str(folder), "--method", "pbs", "--tokens", "128", "--plots", str(tmp_path / "p")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "plots need matplotlib" in err and "pip install matplotlib" in err
    assert "loading" not in err  # refused before loading the model


# --------------------------------------------------------------------------- the real checkpoint


@pytest.mark.slow
@pytest.mark.skipif(smollm2_gguf() is None, reason=f"SmolLM2 GGUF not installed ({SMOLLM2_PACKAGE_HINT})")
def test_smollm2_gguf_convert_reload_eval(tmp_path, capsys, monkeypatch):
    import gguf

    parses = []
    real_init = gguf.GGUFReader.__init__
    monkeypatch.setattr(
        gguf.GGUFReader, "__init__", lambda self, *a, **kw: parses.append(a) or real_init(self, *a, **kw)
    )
    out = tmp_path / "smollm2-pbs"
    assert main(["convert", str(smollm2_gguf()), "--method", "pbs", "--recipe", "smollm2", "--out", str(out)]) == 0
    # the header check, the config, the tokenizer and the weights share one parse of the file
    assert len(parses) == 1, parses
    plan = json.loads((out / "config.json").read_text())["sparseflow"]
    assert plan["recipe"] == "smollm2" and plan["num_layers"] == 30
    _check_session_cache_matches(out)
    report = tmp_path / "eval.json"
    # 1024 tokens: at 512 a query has a single candidate block, which any threshold keeps
    assert main(["eval", str(out), "--tokens", "1024", "--eval-positions", "128", "--json", str(report)]) == 0
    print(capsys.readouterr().out)
    data = _check_eval_json(report, ["pbs"], layers=30, heads=9, tokens=1024)
    r = data["results"][0]
    dense_layers = set(plan["dense_layers"])
    assert r["dense_calls"] == len(dense_layers) and r["sparse_calls"] == 30 - len(dense_layers)
    assert all(r["density_per_layer"][i] == 1.0 for i in dense_layers)
    assert r["density"] < 1.0
    assert r["mean_kl"] < 0.1 and r["top1_agreement"] > 0.85, r


def _check_session_cache_matches(converted):
    """The session cache that load_smollm2() reads (tests/_smollm2_cache.py) holds exactly the
    weights that converting the GGUF file directly writes."""
    from safetensors.torch import load_file

    import _smollm2_cache
    from sparseflow.checkpoints import _cached_folder

    cached = _cached_folder(smollm2_gguf(), Path(_smollm2_cache.CACHE_DIR))
    a, b = load_file(str(converted / "model.safetensors")), load_file(str(cached / "model.safetensors"))
    assert sorted(a) == sorted(b) and len(a) > 100
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize(
    "kind, dtype, device, want",
    [
        ("gguf", "auto", None, "float32"),
        ("gguf", "auto", "cpu", "float32"),
        ("gguf", "auto", "cuda", "bfloat16"),
        ("gguf", "auto", "cuda:1", "bfloat16"),
        ("gguf", "float32", "cuda", "float32"),
        ("hf", "auto", "cuda", "auto"),
        ("hf", "float16", "cpu", "float16"),
    ],
    ids=lambda v: str(v),
)
def test_load_source_dtype_follows_the_device_for_a_gguf(monkeypatch, tmp_path, kind, dtype, device, want):
    # a GGUF dequantises to fp32; on CUDA it runs in bf16, the dtype served there (calibrate's
    # timings and eval's fidelity are then the served dtype's, not IEEE fp32's)
    import transformers

    from sparseflow import convert as convert_mod

    seen = {}

    class Stop(Exception):
        pass

    def fake_from_pretrained(folder, dtype=None, **kw):
        seen["dtype"] = dtype
        raise Stop

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake_from_pretrained)
    source = convert_mod.Source(kind, tmp_path, "m.gguf" if kind == "gguf" else None)
    with pytest.raises(convert_mod.ConversionError, match="Stop"):
        convert_mod.load_source(source, dtype=dtype, device=device)
    assert str(seen["dtype"]).replace("torch.", "") == want
