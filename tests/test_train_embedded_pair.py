"""The shipped embedded pair (python/ddtree/embedded_pair): a trained hybrid Qwen3.5-text target
and its trained DFlash drafter. On held-out stdlib prompts the drafter must earn its keep —
τ(tree, budget 64) > τ(chain) > 1.5 — and every mode must be lossless against the target's own
greedy decoding (transformers' generate) on a trained hybrid model."""
import json

import pytest
import torch

from ddtree import cli, embedded
from ddtree.train import corpus, embedded_pair
from ddtree.generate import generate

PROMPTS, NEW_TOKENS = 6, 64


@pytest.fixture(scope="module")
def pair():
    return embedded.load()


@pytest.fixture(scope="module")
def prompts(pair):
    tokenizer = pair[2]
    texts = embedded.heldout_prompts(PROMPTS)
    assert len(texts) == PROMPTS
    return [tokenizer(t, return_tensors="pt").input_ids for t in texts]


def test_pair_is_committed_in_the_published_formats():
    root = embedded.PAIR_DIR
    size = sum(f.stat().st_size for d in (embedded.target_dir(), embedded.drafter_dir())
               for f in d.iterdir())
    assert size <= 30 * 2 ** 20
    drafter_cfg = json.loads((embedded.drafter_dir() / "config.json").read_text())
    assert drafter_cfg["architectures"] == ["DFlashDraftModel"]
    assert drafter_cfg["block_size"] == 16
    assert drafter_cfg["dflash_config"]["target_layer_ids"] == embedded_pair.DRAFT_TARGET_LAYER_IDS
    recipe = json.loads((root / "recipe.json").read_text())
    for key in ("seed", "python", "target", "drafter", "total_seconds"):
        assert key in recipe
    assert recipe["target"]["config"] == json.loads(json.dumps(embedded_pair.TARGET_CONFIG))
    target_cfg = json.loads((embedded.target_dir() / "config.json").read_text())
    assert target_cfg["model_type"] == "qwen3_5_text"
    assert "linear_attention" in target_cfg["layer_types"]


def test_tree_beats_chain_beats_one_token_per_forward(pair, prompts):
    target, drafter, tokenizer = pair
    stops = [tokenizer.eos_token_id]
    tau = {}
    for mode in ("chain", "tree"):
        lengths = []
        for ids in prompts:
            r = generate(target, drafter, ids, NEW_TOKENS, mode=mode, budget=64,
                         stop_token_ids=stops)
            lengths += r.acceptance_lengths
        tau[mode] = sum(lengths) / len(lengths)
    assert tau["tree"] > tau["chain"] > 1.5, tau


@pytest.mark.parametrize("mode,budget", [("tree", 64), ("tree", 256), ("chain", 15)])
def test_lossless_on_the_trained_hybrid_pair(pair, prompts, mode, budget):
    target, drafter, _ = pair
    for ids in prompts[:3]:
        want = target.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None,
                               pad_token_id=None, attention_mask=torch.ones_like(ids))
        got = generate(target, drafter, ids, 40, mode=mode, budget=budget)
        assert got.tokens == want[0, ids.shape[1]:].tolist()


def test_heldout_prompts_come_from_heldout_files():
    """Every prompt is text of a held-out stdlib file (crc32 split), none of a training file."""
    texts = embedded.heldout_prompts(3)
    assert len(texts) == 3 and all(t.endswith(":\n") and "def " in t for t in texts)
    assert texts == embedded.heldout_prompts(3)  # deterministic
    root = corpus.stdlib_root()
    held = corpus.read_texts(corpus.stdlib_files("heldout"))
    for t in texts:
        sources = [p for p, text in zip(corpus.stdlib_files("heldout"), held) if t in text]
        assert sources, f"prompt not found in a held-out file: {t!r}"
        assert all(corpus.is_heldout(p.relative_to(root).as_posix()) for p in sources)


def test_cli_generate_on_the_embedded_pair(capsys):
    rc = cli.main(["generate", "--target", "embedded", "--draft", "embedded", "--prompt", "def ",
                   "--max-new-tokens", "24"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "[ddtree] mode=tree tokens=" in out
    path = str(embedded.target_dir())
    rc = cli.main(["generate", "--target", path, "--draft", str(embedded.drafter_dir()),
                   "--prompt", "class ", "--max-new-tokens", "8", "--mode", "chain"])
    assert rc == 0 and "mode=chain" in capsys.readouterr().out


def test_missing_pair_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="make embedded-pair"):
        embedded.load(root=tmp_path)


def test_every_file_of_the_pair_is_package_data():
    """setup.py's package_data globs cover every file of the pair, so an install carries it."""
    import fnmatch
    import re
    from pathlib import Path

    setup_text = (Path(__file__).resolve().parent.parent / "setup.py").read_text()
    globs = re.findall(r'"(embedded_pair/[^"]+)"', setup_text)
    assert globs
    package = Path(embedded.__file__).parent
    files = [p.relative_to(package).as_posix() for p in Path(embedded.PAIR_DIR).rglob("*") if p.is_file()]
    assert len(files) >= 8
    for f in files:
        assert any(fnmatch.fnmatch(f, g) and f.count("/") == g.count("/") for g in globs), f
