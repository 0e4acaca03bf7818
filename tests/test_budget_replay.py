"""budget="auto"'s policy replayed on recorded drafts (ddtree.budget.replay): the recording
matches the drafter and the loop, and the policy meets the speed goals on the recorded held-out
drafts of the embedded pair under several cost regimes, with no machine noise."""
import json
from pathlib import Path

import pytest
import torch

import ddtree
from ddtree import budget as cost_aware
from ddtree import cli, embedded
from ddtree.budget import replay as policy_replay
from ddtree.generate import generate_batch, record_drafts
from helpers import ScriptedBudgets, tiny_drafter, tiny_target

DATA = Path(__file__).parent / "data" / "policy_replay.json"

# Cost regimes (ms per round; 0 = autoregressive). Measured: medians of the embedded pair's
# rounds at batch 1 on a 2-core x86 VM, fp32 (8 held-out prompts x 2, buckets interleaved).
# Cheap verify: a memory-bound target (large model, small batch, GPU): verifying 64 nodes
# costs little more than one token. Dear verify: compute bound, a round's cost grows with its
# rows (large batches).
REGIMES = {
    "measured": {0: 7.21, 4: 15.24, 8: 16.2, 16: 17.86, 32: 19.76, 64: 23.3},
    "cheap verify": {0: 10.0, 4: 13.0, 8: 13.2, 16: 13.5, 32: 14.0, 64: 15.0},
    "dear verify": {0: 10.0, 4: 40.0, 8: 60.0, 16: 100.0, 32: 180.0, 64: 350.0},
}


@pytest.fixture(scope="module")
def records():
    return [policy_replay.DraftRecord.from_json(r) for r in json.loads(DATA.read_text())["records"]]


def test_recorded_drafts_match_the_drafter_and_the_loop():
    """A fresh recording on the embedded pair equals the stored one (the data is the current
    drafter's); a fixed bucket's replay emits exactly the loop's acceptance lengths (a real
    generate_batch of tree 16 and of tree 4 on the same prompt)."""
    stored = json.loads(DATA.read_text())
    target, drafter, tokenizer = embedded.load()
    prompt = tokenizer(embedded.heldout_prompts(1)[0], return_tensors="pt").input_ids[0]
    fresh = record_drafts(target, drafter, prompt, stored["new_tokens"])
    first = policy_replay.DraftRecord.from_json(stored["records"][0])
    assert fresh.emitted == first.emitted
    for mine, stored_row in zip(fresh.expected, first.expected):
        assert mine == pytest.approx(stored_row, abs=1e-3)
    for bucket in (4, 16):
        loop = generate_batch(target, drafter, [prompt], stored["new_tokens"], budget=bucket)[0]
        replayed = policy_replay.replay(first, {b: 1.0 for b in first.buckets},
                                        cost_aware.FixedBucket(bucket))
        assert replayed.emitted == loop.acceptance_lengths


def test_a_batched_replay_is_the_batched_loop(records):
    """replay_batch at batch 4 (the stored drafts of the first 4 held-out prompts) against a
    real generate_batch of tree 16 on those prompts: the same tokens per round over the batch,
    and the same rounds at each verify batch size as finished requests leave (the loop's
    round_batch_sizes), priced at that size's cost."""
    target, drafter, tokenizer = embedded.load()
    prompts = [tokenizer(t, return_tensors="pt").input_ids[0]
               for t in embedded.heldout_prompts(4)]
    new_tokens = len(records[0].emitted) + 1
    loop = generate_batch(target, drafter, prompts, new_tokens, budget=16)
    costs = {size: {b: float(size) for b in records[0].buckets} for size in (1, 2, 4)}
    replayed = policy_replay.replay_batch(records[:4], costs, cost_aware.FixedBucket(16))
    rounds = max(len(r.acceptance_lengths) for r in loop)
    assert replayed.emitted == [sum(r.acceptance_lengths[i] for r in loop
                                    if i < len(r.acceptance_lengths)) for i in range(rounds)]
    longest = max(loop, key=lambda r: len(r.acceptance_lengths))
    assert len(set(longest.round_batch_sizes)) > 1  # the batch shrank
    assert replayed.ms == sum(longest.round_batch_sizes)


def test_batched_replays_price_each_batch_size(records):
    """speedups at batch 4: the records in generations of 4, auto and the fixed trees priced by
    each batch size's costs (a dear verify at 4 and 2, a cheap one at 1: the fixed trees pay
    only once a batch is down to its last request); a missing batch size is refused by
    name."""
    cheap, dear = REGIMES["cheap verify"], REGIMES["dear verify"]
    speed = policy_replay.speedups(records, {4: dear, 2: dear, 1: cheap}, batch=4)
    alone = policy_replay.speedups(records, {4: dear, 2: dear, 1: dear}, batch=4)
    assert speed["tree 16"] > alone["tree 16"] and alone["tree 16"] < 1.0
    assert speed["auto"] >= 1.0 - cost_aware.AutoBudget.probe_overhead, speed
    # A (last, partial) generation of 3 requests is priced at batch 4's costs: autoregressive
    # rounds keep all three live to the end.
    partial = policy_replay.replay_batch(records[:3], {4: dear, 2: dear, 1: cheap},
                                         cost_aware.FixedBucket(0))
    assert partial.ms == pytest.approx(len(records[0].emitted) * dear[0])
    with pytest.raises(ValueError, match="batch sizes"):
        policy_replay.speedups(records, {4: dear, 1: cheap}, batch=4)


def test_replay_records_a_tiny_pair():
    """record_drafts on a tiny random pair: one row per position, 1 token for bucket 0, at most
    1 + min(bucket, depth) for the others, expected nodes non-decreasing in the bucket among
    the buckets read from the full draft (a bucket shallower than the drafter has its own);
    bucket 4's row is the tree of a fresh draft of 4 depths."""
    target, drafter = tiny_target(seed=3), tiny_drafter()
    record = record_drafts(target, drafter, torch.tensor([3, 9, 4, 7]), 12)
    assert len(record.expected) == len(record.emitted) == 11
    for expected, emitted in zip(record.expected, record.emitted):
        assert emitted[0] == 1 and expected[0] == 0.0
        assert all(1 <= e <= 1 + min(b, record.depth) for b, e in zip(record.buckets, emitted))
        full = [e for b, e in zip(record.buckets, expected) if b == 0 or b >= record.depth]
        assert full == sorted(full)
    prompt = torch.tensor([3, 9, 4, 7])
    tokens = generate_batch(target, None, [prompt], 1, mode="autoregressive")[0].tokens
    hidden = target(input_ids=prompt[None], output_hidden_states=True).hidden_states
    state = drafter.begin(target, [hidden], 4 + 2 * record.depth + 2)
    root = torch.tensor(tokens[:1])
    logits = state.step(root, 4)
    assert logits.shape[1] == 4
    tree = ddtree.ops.draft_tree(logits, root, max(record.buckets))
    nodes = ddtree.ops.expected_accepts(tree)[0, 4].item()
    assert record.expected[0][record.buckets.index(4)] == pytest.approx(nodes)


@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_auto_meets_the_speed_goals_on_recorded_drafts(records, regime):
    """On the recorded held-out drafts, priced by each regime: auto is at least 0.95x the best
    fixed tree and at least as fast as autoregressive decoding where some tree pays. Where
    verifying is dear every fixed tree loses to autoregressive decoding (the failure auto exists
    for) and auto decodes, paying only for its probes: at most probe_overhead (5 %) of the
    rounds they wait — a bounded price for finding the prompts where drafting pays."""
    costs = REGIMES[regime]
    speed = policy_replay.speedups(records, costs)
    trees = {k: v for k, v in speed.items() if k.startswith("tree")}
    assert speed["auto"] >= 0.95 * max(max(trees.values()), 1.0), speed
    if regime == "dear verify":
        assert all(v < 1.0 for v in trees.values()), speed
        assert speed["auto"] >= 1.0 - cost_aware.AutoBudget.probe_overhead, speed
    else:
        assert speed["auto"] >= 1.0, speed


def test_auto_keeps_its_goals_with_a_noisy_clock(records):
    """The policy corrects its costs by the rounds' wall times: told those of a machine whose
    speed drifts (JitteredClock: slow and fast spells, 6 % jitter per round), auto still beats
    autoregressive decoding and stays within 0.95x of the best fixed tree at the measured costs
    (the rounds priced at the costs themselves), for every seed."""
    costs = REGIMES["measured"]
    for seed in range(3):
        speed = policy_replay.speedups(records, costs,
                                       clock=policy_replay.JitteredClock(seed))
        best = max(v for k, v in speed.items() if k.startswith("tree"))
        assert speed["auto"] >= max(1.0, 0.95 * best), (seed, speed)


def _switches(choices):
    """(drafted rounds after an autoregressive one, autoregressive rounds after a drafted one)."""
    pairs = list(zip(choices, choices[1:]))
    return sum(a == 0 < b for a, b in pairs), sum(b == 0 < a for a, b in pairs)


def test_switches_are_priced(records, capsys):
    """switch_ms = (into, out of): a drafted round right after an autoregressive one costs `into`
    more, an autoregressive round right after a drafted one `out of` more; nothing else changes
    (the same rounds), fixed trees never switch, auto (its costs not learned, so the same choices)
    is slower by what its switches cost; the command line's --switch-ms prints that; negative or
    malformed values are refused by name."""
    costs = REGIMES["measured"]
    script = [0, 0, 8, 8, 0, 16, 16, 0, 0, 0, 4]
    plain = policy_replay.replay(records[0], costs, ScriptedBudgets(script))
    priced = policy_replay.replay(records[0], costs, ScriptedBudgets(script), switch_ms=(2.0, 1.5))
    into, out_of = _switches(priced.choices)
    assert priced.choices == plain.choices and into > 0 and out_of > 0
    assert priced.ms == pytest.approx(plain.ms + 2.0 * into + 1.5 * out_of)
    fixed = policy_replay.auto(costs, learn_costs=False)
    before = policy_replay.speedups(records, costs, fixed)
    after = policy_replay.speedups(records, costs, fixed, switch_ms=(2.0, 1.5))
    runs = policy_replay.replay_all(records, costs, fixed)
    switched = [_switches(r.choices) for r in runs]
    extra = sum(2.0 * i + 1.5 * o for i, o in switched)
    assert extra > 0 and after["tree 16"] == before["tree 16"]
    assert 1 / after["auto"] == pytest.approx(1 / before["auto"] + extra / sum(
        r.ms for r in policy_replay.replay_all(records, costs,
                                               lambda prior: cost_aware.FixedBucket(0))))
    assert cli.main(["replay", "--records", str(DATA), "--costs", json.dumps(
        {str(b): ms for b, ms in costs.items()}), "--switch-ms", "2", "1.5"]) == 0
    assert f"auto  {policy_replay.speedups(records, costs, switch_ms=(2.0, 1.5))['auto']:.3f}x" \
        in capsys.readouterr().out
    for bad in ((-1.0, 0.0), (1.0,), (float("inf"), 0.0), "2 1"):
        with pytest.raises(ValueError, match="switch_ms"):
            policy_replay.replay(records[0], costs, cost_aware.FixedBucket(0), switch_ms=bad)
    assert cli.main(["replay", "--records", str(DATA), "--costs", "{}", "--switch-ms", "-1", "0"]) == 2
    assert "--switch-ms" in capsys.readouterr().err


def test_command_line_records_from_a_given_prompt_and_replays_stored_records(tmp_path, capsys,
                                                                            monkeypatch):
    """`--first 1 --prompts 1 --out F` records the second held-out prompt (the stored data's
    second record); `--records F --costs C` replays the stored records without loading the
    pair, printing what speedups gives on them; a range past the held-out prompts, unreadable
    records and costs that are not a JSON object or miss a bucket are refused by name."""
    stored = json.loads(DATA.read_text())
    out = tmp_path / "one.json"
    costs = REGIMES["measured"]
    costs_json = json.dumps({str(b): ms for b, ms in costs.items()})
    assert cli.main(["replay", "--first", "1", "--prompts", "1", "--out", str(out),
                               "--costs", costs_json]) == 0
    written = json.loads(out.read_text())["records"]
    assert len(written) == 1 and written[0]["emitted"] == stored["records"][1]["emitted"]
    capsys.readouterr()

    def no_pair(*args, **kwargs):
        raise AssertionError("replaying records at given costs needs no model")

    monkeypatch.setattr(embedded, "load", no_pair)
    assert cli.main(["replay", "--records", str(DATA), "--costs", costs_json]) == 0
    printed = capsys.readouterr().out
    records = [policy_replay.DraftRecord.from_json(r) for r in stored["records"]]
    assert f"auto  {policy_replay.speedups(records, costs)['auto']:.3f}x" in printed
    for costs_arg in ("[1, 2]", '{"0": 1.0, "4": 2.0}'):
        assert cli.main(["replay", "--records", str(DATA), "--costs", costs_arg]) == 2
        assert "--costs" in capsys.readouterr().err
    # --batch 4: generations of 4 records, a cost table per batch size (4, 2 and 1).
    tables = {n: REGIMES["dear verify" if n > 1 else "measured"] for n in (1, 2, 4)}
    tables_json = json.dumps({str(n): {str(b): ms for b, ms in t.items()}
                              for n, t in tables.items()})
    assert cli.main(["replay", "--records", str(DATA), "--costs", tables_json,
                               "--batch", "4"]) == 0
    printed = capsys.readouterr().out
    assert f"auto  {policy_replay.speedups(records, tables, batch=4)['auto']:.3f}x" in printed
    assert "round cost (ms), batch 2: 0: 10.00" in printed
    # ... or the cost profiles of a bench_concurrency.py JSON.
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"profiles": {str(n): {"batch": n, "round_ms": {
        str(b): ms for b, ms in t.items()}} for n, t in tables.items()}}))
    assert cli.main(["replay", "--records", str(DATA), "--profiles", str(bench),
                               "--batch", "4"]) == 0
    assert capsys.readouterr().out == printed
    for bad in (tmp_path / "missing.json", DATA):
        assert cli.main(["replay", "--records", str(DATA), "--profiles", str(bad), "--batch", "4"]) == 2
        assert "--profiles" in capsys.readouterr().err
    without_2 = json.dumps({n: v for n, v in json.loads(tables_json).items() if n != "2"})
    for costs_arg in (costs_json, without_2):
        assert cli.main(["replay", "--records", str(DATA), "--costs", costs_arg, "--batch", "4"]) == 2
        assert "--costs" in capsys.readouterr().err
    monkeypatch.undo()
    count = len(embedded.heldout_prompts(1000))
    assert cli.main(["replay", "--first", str(count), "--prompts", "1"]) == 2
    assert "--first" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text('{"records": [{"buckets": [0, 4]}]}')
    for bad in (tmp_path / "missing.json", tmp_path / "bad.json"):
        assert cli.main(["replay", "--records", str(bad), "--costs", costs_json]) == 2
        assert "--records" in capsys.readouterr().err
