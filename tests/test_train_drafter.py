"""Drafter training (ddtree.train): the training forward computes exactly what the drafter computes
at inference, the loss follows the DFlash recipe, training lowers it, the CLI saves a checkpoint
in the published format; the stdlib corpus split."""
import json

import pytest
import torch

from ddtree.train import corpus, optimise
from ddtree.train import drafter as training
from ddtree.models import DFlashDrafter
from helpers import propose, tiny_drafter, tiny_target, VOCAB


def _context(target, drafter, tokens):
    out = target(input_ids=tokens, output_hidden_states=True)
    return drafter.target_features(out.hidden_states)


@pytest.mark.parametrize("layers", [1, 2])
def test_block_logits_equal_the_inference_proposals(layers):
    """Every anchor's block of the one-pass training forward == the host-list drafter step (helpers.propose) with the context of
    the positions before the anchor and the anchor token as bonus."""
    target = tiny_target()
    drafter = tiny_drafter(block_size=8)
    if layers == 2:
        drafter = DFlashDrafter(training.drafter_config_for(target, 2, VOCAB - 1, 8)).eval()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB - 1, (2, 30), generator=g)
    anchors = torch.tensor([[1, 9, 22], [5, 5, 17]])
    with torch.no_grad():
        feats = _context(target, drafter, tokens)
        got = training.block_logits(drafter, target, feats, tokens, anchors)
        assert got.shape == (2, 3, 7, VOCAB)
        for b in range(2):
            for m in range(3):
                a = int(anchors[b, m])
                cache = drafter.new_cache()
                want = propose(drafter, target, tokens[b, a:a + 1], feats[b:b + 1, :a], cache)
                torch.testing.assert_close(got[b, m], want[0], rtol=1e-4, atol=1e-4)


def test_loss_is_the_weighted_cross_entropy_of_the_recipe():
    target, drafter = tiny_target(), tiny_drafter(block_size=8)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB - 1, (2, 24), generator=g)
    anchors = torch.tensor([[3, 10], [0, 16]])
    gamma = 3.0
    with torch.no_grad():
        feats = _context(target, drafter, tokens)
        loss = training.drafter_loss(drafter, target, feats, tokens, anchors, gamma)
        logits = training.block_logits(drafter, target, feats, tokens, anchors)
    total, weights = 0.0, 0.0
    for b in range(2):
        for m in range(2):
            for k in range(1, 8):  # block row k predicts the token k places after the anchor
                w = float(torch.exp(torch.tensor(-(k - 1) / gamma)))
                lp = torch.log_softmax(logits[b, m, k - 1].double(), -1)
                total += -w * float(lp[tokens[b, int(anchors[b, m]) + k]])
                weights += w
    assert abs(float(loss) - total / weights) < 1e-4


def test_training_lowers_the_loss_and_saves_the_dflash_format(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(block_size=8)
    stream = torch.randint(0, VOCAB - 1, (2000,), generator=torch.Generator().manual_seed(2))
    recipe = training.DrafterRecipe(steps=30, batch=4, anchors=4, sequences=16, prompt_len=8,
                                 gen_len=16, lr=3e-3, warmup=3)
    info = training.train_drafter(target, drafter, stream, recipe, str(tmp_path), quiet=True)
    log = [json.loads(line) for line in open(tmp_path / "drafter_log.jsonl")]
    assert [row["step"] for row in log] == [10, 20, 30]
    assert log[-1]["loss"] < log[0]["loss"]
    assert info["recipe"]["labels"] == "greedy"
    loaded = DFlashDrafter.from_pretrained(str(tmp_path))
    for (name, a), b in zip(drafter.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    # Resuming from the saved state at the last step trains nothing more and gives the same weights.
    again = tiny_drafter(block_size=8, seed=7)
    training.train_drafter(target, again, stream, recipe, str(tmp_path), resume=True, quiet=True)
    assert all(torch.equal(a, b) for a, b in zip(drafter.parameters(), again.parameters()))


def test_greedy_sequences_continue_with_the_targets_argmax():
    """Each generated token is the target's argmax after the sequence before it (teacher-forced
    check over the whole sequence, token 0 in the prompts included)."""
    target = tiny_target()
    prompts = torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(3))
    prompts[0, 1] = 0
    seqs = training.greedy_sequences(target, prompts, 6, batch=2, quiet=True)
    assert seqs.shape == (3, 11) and torch.equal(seqs[:, :5], prompts)
    with torch.no_grad():
        argmax = target(input_ids=seqs).logits.argmax(-1)
    assert torch.equal(argmax[:, 4:10], seqs[:, 5:])


def test_bad_training_input(tmp_path):
    target, drafter = tiny_target(), tiny_drafter(block_size=8)
    stream = torch.arange(50) % (VOCAB - 1)
    with pytest.raises(ValueError, match="labels must be"):
        training.train_drafter(target, drafter, stream, training.DrafterRecipe(labels="x", sequences=2),
                            str(tmp_path), quiet=True)
    with pytest.raises(ValueError, match="fewer than one window"):
        training.train_drafter(target, drafter, stream, training.DrafterRecipe(sequences=2), str(tmp_path),
                            quiet=True)
    with pytest.raises(ValueError, match="split must be"):
        corpus.stdlib_files("validation")
    with pytest.raises(ValueError, match="corpus"):
        corpus.corpus_texts(str(tmp_path / "missing"))


def test_stdlib_split_is_disjoint_and_stable():
    held, trained = corpus.stdlib_files("heldout"), corpus.stdlib_files("train")
    assert held and trained and not set(held) & set(trained)
    assert len(held) < len(trained) / 4
    root = corpus.stdlib_root()
    assert all(corpus.is_heldout(p.relative_to(root).as_posix()) for p in held)
    assert not any("site-packages" in p.parts for p in held + trained)


def test_non_finite_loss_stops_training(tmp_path):
    model = torch.nn.Linear(2, 2)
    losses = iter([1.0, float("nan")])
    run = optimise.Run(str(tmp_path), "drafter", 5, True, {"lr": 1e-3})
    with pytest.raises(FloatingPointError, match="loss is nan at step 2"):
        optimise.optimise(model, list(model.parameters()), 5, 1e-3, 0,
                        lambda: model.weight.sum() * 0 + next(losses), run, torch.Generator(),
                        False, 0)
    target, drafter = tiny_target(), tiny_drafter(block_size=8)
    stream = torch.arange(500) % (VOCAB - 1)
    with pytest.raises(ValueError, match="--gamma must be a finite number > 0, got 0"):
        training.train_drafter(target, drafter, stream, training.DrafterRecipe(gamma=0.0), str(tmp_path),
                            quiet=True)


def test_resume_checks_the_recipe_and_cuts_the_log_back(tmp_path):
    target = tiny_target()
    stream = torch.randint(0, VOCAB - 1, (2000,), generator=torch.Generator().manual_seed(2))
    recipe = training.DrafterRecipe(steps=20, batch=2, anchors=2, sequences=8, prompt_len=8,
                                 gen_len=16, lr=3e-3, warmup=3, labels="data")
    training.train_drafter(target, tiny_drafter(block_size=8), stream, recipe, str(tmp_path),
                        quiet=True)
    log = tmp_path / "drafter_log.jsonl"
    with open(log, "a") as f:  # rows of a run that went on past the saved state
        f.write(json.dumps({"step": 30, "loss": 1.0}) + "\n" + json.dumps({"step": 40}) + "\n")
    training.train_drafter(target, tiny_drafter(block_size=8), stream, recipe, str(tmp_path),
                        resume=True, quiet=True)
    assert [json.loads(line)["step"] for line in open(log)] == [10, 20]
    other = training.DrafterRecipe(**{**recipe.__dict__, "lr": 4e-3, "anchors": 3})
    with pytest.raises(ValueError, match=r"another recipe \(anchors: saved 2, now 3, lr: saved "
                                         r"0.003, now 0.004\)"):
        training.train_drafter(target, tiny_drafter(block_size=8), stream, other, str(tmp_path),
                            resume=True, quiet=True)
