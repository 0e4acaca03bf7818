"""`ddtree generate` / `ddtree bench` on a tiny model saved in Hugging Face format."""
import json

import pytest
import torch

from ddtree import cli
from helpers import tiny_drafter, tiny_target, VOCAB


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("models")
    target = tiny_target()
    target.save_pretrained(str(root / "target"))
    vocab = {f"w{i}": i for i in range(VOCAB - 2)}
    vocab["<unk>"] = VOCAB - 2
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    fast.save_pretrained(str(root / "target"))
    tiny_drafter().save_pretrained(str(root / "draft"))
    return root


def test_generate_streams_text_and_summary(model_dirs, capsys):
    rc = cli.main(["generate", "--target", str(model_dirs / "target"), "--draft",
                   str(model_dirs / "draft"), "--prompt", "w5 w17 w42", "--max-new-tokens", "12",
                   "--budget", "16"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "[ddtree] mode=tree tokens=12 tau=" in out
    assert out.split("\n")[0].strip().startswith("w")


def test_generate_with_tree_attention_and_cuda_graph_flags(model_dirs, capsys):
    args = ["generate", "--target", str(model_dirs / "target"), "--draft", str(model_dirs / "draft"),
            "--prompt", "w5 w17 w42", "--max-new-tokens", "8", "--budget", "8"]
    assert cli.main(args) == 0
    plain = capsys.readouterr().out.split("\n")[0]
    assert cli.main(args + ["--tree-attention"]) == 0
    assert capsys.readouterr().out.split("\n")[0] == plain
    if not torch.cuda.is_available():
        assert cli.main(args + ["--cuda-graph"]) == 2
        assert "cuda_graph=True needs the target on a CUDA device" in capsys.readouterr().err


def test_bench_compares_modes_and_plots(model_dirs, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w1 w2 w3\nw9 w8\n")
    rc = cli.main(["bench", "--target", str(model_dirs / "target"), "--draft",
                   str(model_dirs / "draft"), "--prompts", str(prompts), "--max-new-tokens", "10",
                   "--budget", "8", "--json", str(tmp_path / "b.json"), "--plot",
                   str(tmp_path / "b.png")])
    assert rc == 0
    rows = json.loads((tmp_path / "b.json").read_text())
    assert [r["mode"] for r in rows] == ["autoregressive", "chain", "tree"]
    assert (tmp_path / "b.png").stat().st_size > 1000
    assert "speed-up" in capsys.readouterr().out


def test_bench_in_batches(model_dirs, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w1 w2 w3\nw9 w8\nw4\n")
    rc = cli.main(["bench", "--target", str(model_dirs / "target"), "--draft",
                   str(model_dirs / "draft"), "--prompts", str(prompts), "--max-new-tokens", "8",
                   "--budget", "8", "--batch-size", "2", "--json", str(tmp_path / "b.json")])
    assert rc == 0
    rows = json.loads((tmp_path / "b.json").read_text())
    assert [r["batch_size"] for r in rows] == [2, 2, 2]
    assert all(r["tokens"] == 3 * 8 for r in rows)  # no stop token in the tiny vocabulary
    assert cli.main(["bench", "--target", str(model_dirs / "target"), "--draft",
                     str(model_dirs / "draft"), "--prompts", str(prompts), "--batch-size", "0"]) == 2
    assert "--batch-size must be >= 1, got 0" in capsys.readouterr().err


def test_generate_requires_a_draft_for_tree_mode(model_dirs):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--target", str(model_dirs / "target"), "--prompt", "w1"])


def _files(directory):
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}


def _train_args(model_dirs, out, *extra):
    return ["train-drafter", "--target", str(model_dirs / "target"), "--out", str(out),
            "--mask-token-id", "3", "--labels", "data", "--steps", "2", "--batch", "2",
            "--anchors", "2", "--sequences", "4", "--prompt-len", "8", "--gen-len", "16",
            "--layers", "1", "--block-size", "4", "--quiet", *extra]


def test_train_drafter_never_writes_over_the_target_or_foreign_files(model_dirs, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(f"w{i % 90}" for i in range(400)))
    target = model_dirs / "target"
    before = _files(target)
    for out in (target, target / "sub"):
        assert cli.main(_train_args(model_dirs, out, "--corpus", str(corpus), "--overwrite")) == 2
        assert "inside the target's directory" in capsys.readouterr().err
    assert _files(target) == before and not (target / "sub").exists()
    # A directory holding someone else's files (here: another model) is refused without
    # --overwrite, and its files are left alone with it.
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    (other / "config.json").write_text('{"model_type": "qwen3"}')
    assert cli.main(_train_args(model_dirs, other, "--corpus", str(corpus))) == 2
    err = capsys.readouterr().err
    assert "not train-drafter output" in err and "notes.txt" in err and "config.json" in err
    assert (other / "config.json").read_text() == '{"model_type": "qwen3"}'
    assert cli.main(_train_args(model_dirs, other, "--corpus", str(corpus), "--overwrite")) == 0
    assert (other / "notes.txt").read_text() == "keep me"
    # Its own earlier output is fine (written again); no temporary file is left behind.
    out = tmp_path / "drafter"
    assert cli.main(_train_args(model_dirs, out, "--corpus", str(corpus))) == 0
    assert cli.main(_train_args(model_dirs, out, "--corpus", str(corpus))) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "model.safetensors", "training.json", "drafter_state.pt",
         "drafter_log.jsonl"])


@pytest.mark.parametrize("flag, value, message", [
    ("--gamma", "0", "--gamma must be a finite number > 0, got 0.0"),
    ("--lr", "nan", "--lr must be a finite number > 0, got nan"),
    ("--batch", "0", "--batch must be an integer >= 1, got 0"),
    ("--steps", "-1", "--steps must be an integer >= 1, got -1"),
    ("--block-size", "40", "--block-size in [2, 33]"),
    ("--target", "/nonexistent/model", "--target '/nonexistent/model': no such directory"),
])
def test_train_drafter_rejects_bad_settings_by_name(model_dirs, tmp_path, capsys, flag, value,
                                                     message):
    args = _train_args(model_dirs, tmp_path / "out")
    if flag in args:
        args[args.index(flag) + 1] = value
    else:
        args += [flag, value]
    assert cli.main(args) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_cli_input_errors_name_the_input(model_dirs, tmp_path, capsys):
    common = ["--draft", str(model_dirs / "draft")]
    assert cli.main(["generate", "--target", str(tmp_path / "nope"), *common, "--prompt", "w1"]) == 2
    assert "--target" in capsys.readouterr().err
    assert cli.main(["generate", "--target", str(model_dirs / "target"), "--draft",
                     str(tmp_path), "--prompt", "w1"]) == 2
    err = capsys.readouterr().err
    assert "--draft" in err and "no config.json" in err
    prompts = tmp_path / "latin1.txt"
    prompts.write_bytes(b"caf\xe9 w1\n")
    assert cli.main(["bench", "--target", str(model_dirs / "target"), *common, "--prompts",
                     str(prompts)]) == 2
    assert f"--prompts '{prompts}': not UTF-8 text" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: usage + the message, exit status 2
        cli.main(["generate", "--target", str(model_dirs / "target"), *common, "--prompt", "w1",
                  "--budget", "-3"])
    assert "argument --budget: must be >= 0, got -3" in capsys.readouterr().err


def test_demo_runs_and_is_lossless(capsys):
    """`make demo`'s main job: every mode on the embedded default emits the greedy tokens."""
    from ddtree import demo

    demo.main()
    out = capsys.readouterr().out
    assert "lossless: every mode == autoregressive greedy tokens: True" in out
    assert "tree + tree_attention" in out
