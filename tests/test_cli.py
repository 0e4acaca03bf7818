"""`ddtree generate` / `ddtree bench` on a tiny model saved in Hugging Face format."""
import json

import pytest
import torch

from ddtree import cli
from test_generate import VOCAB, tiny_drafter, tiny_target


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
        with pytest.raises(ValueError, match="cuda_graph=True needs the target on a CUDA device"):
            cli.main(args + ["--cuda-graph"])


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
    with pytest.raises(SystemExit, match="--batch-size must be >= 1"):
        cli.main(["bench", "--target", str(model_dirs / "target"), "--draft",
                  str(model_dirs / "draft"), "--prompts", str(prompts), "--batch-size", "0"])


def test_generate_requires_a_draft_for_tree_mode(model_dirs):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--target", str(model_dirs / "target"), "--prompt", "w1"])


def test_demo_runs_and_is_lossless(capsys):
    """`make demo`'s main job: every mode on the embedded default emits the greedy tokens."""
    from ddtree import demo

    demo.main()
    out = capsys.readouterr().out
    assert "lossless: every mode == autoregressive greedy tokens: True" in out
    assert "tree + tree_attention" in out
