"""One-level draft trees: runner-up tokens verified in spare rows of a greedy target pass."""

from __future__ import annotations

import pytest
import torch
from chi_square import SIGNIFICANCE, goodness_of_fit_pvalue
from marks import needs_kernels
from test_eagle import trained_head  # noqa: F401 - a fixture
from tiny_models import noisy_copy, tiny_config, tiny_target
from transformers import Qwen2ForCausalLM

from verispec.drafters import DraftModel
from verispec.drafters.base import DraftContext, Proposal
from verispec.drafters.draft_model import DraftModelSession
from verispec.engine import SpeculativeDecoder
from verispec.engine.decoder import checked_proposal, pick_branches, verify_tree
from verispec.engine.lean_lm import target_lm
from verispec.models.panel_linear import panel_kernels_unavailable_reason, use_panel_kernels
from verispec.sampling import SamplingParams

@needs_kernels
@pytest.mark.parametrize("head_dim", [8, 128])
def test_a_branch_row_computes_exactly_what_its_token_fed_in_the_chain_computes(head_dim):
    # Chain [x, d1..d5] plus branches standing at rows 1, 3 and 5: each branch row's logits and the
    # keys/values it leaves must equal, bit for bit, a pass feeding that token at that position;
    # the chain rows must be untouched by the branches beside them. Prompt lengths around a multiple
    # of 4 put the branch's own key inside and outside the attention's blocks of four.
    model = use_panel_kernels(tiny_target() if head_dim == 8 else wide_head_target())
    chain = [40, 41, 42, 43, 44, 45]
    branches = [(1, 50, -1), (3, 51, -1), (5, 52, -1)]
    for prompt_length in (13, 14, 15, 16):
        prompt = list(range(3, 3 + prompt_length))
        tree = target_lm(model)
        tree.extend(prompt, num_logits=0)
        assert tree.max_branch_rows() >= len(chain) + len(branches)
        out = tree.extend_branches(chain, branches, argmax_only=False)
        assert out.logits.shape[0] == len(chain) + len(branches)
        reference = target_lm(model)
        reference.extend(prompt, num_logits=0)
        assert torch.equal(out.logits[: len(chain)], reference.extend(chain, num_logits=len(chain)).logits)
        for number, (index, token, _) in enumerate(branches):
            alone = target_lm(model)
            alone.extend(prompt + chain[:index], num_logits=0)
            want = alone.extend([token], num_logits=1).logits[0]
            assert torch.equal(out.logits[len(chain) + number], want), (prompt_length, index)


@needs_kernels
@pytest.mark.parametrize("head_dim", [8, 128])
def test_a_deeper_branch_row_computes_exactly_what_its_path_fed_in_the_chain_computes(head_dim):
    # Branches continuing branches: 50 beside d1 continued by 53 and then 54 (depth 2), 51 beside d3
    # with two children 55 and 56; each row's logits must equal a pass feeding its whole path at its
    # positions, bit for bit, and keeping a path must leave the cache that chain would leave.
    model = use_panel_kernels(tiny_target() if head_dim == 8 else wide_head_target())
    chain = [40, 41, 42, 43, 44, 45]
    branches = [(1, 50, -1), (3, 51, -1), (1, 53, 0), (3, 55, 1), (1, 54, 2), (3, 56, 1)]
    paths = [[50], [51], [50, 53], [51, 55], [50, 53, 54], [51, 56]]
    for prompt_length in (13, 14, 15, 16):
        prompt = list(range(3, 3 + prompt_length))
        tree = target_lm(model)
        tree.extend(prompt, num_logits=0)
        out = tree.extend_branches(chain, branches, argmax_only=False)
        reference = target_lm(model)
        reference.extend(prompt, num_logits=0)
        assert torch.equal(out.logits[: len(chain)], reference.extend(chain, num_logits=len(chain)).logits)
        for number, ((index, _, _), path) in enumerate(zip(branches, paths)):
            alone = target_lm(model)
            alone.extend(prompt + chain[:index] + path[:-1], num_logits=0)
            assert torch.equal(out.logits[len(chain) + number], alone.extend(path[-1:], num_logits=1).logits[0]), (prompt_length, number)
        start = len(prompt)  # keep 40 50 53 54: branches 0, 2, 4 at positions start + 1, 2, 3
        for depth, number in enumerate([0, 2, 4]):
            tree.keep_branch(start + len(chain) + number, start + 1 + depth)
        tree.crop(start + 4)
        kept = target_lm(model)
        kept.extend(prompt + [40, 50, 53, 54], num_logits=0)
        assert tree.token_ids == kept.token_ids
        for mine, theirs in zip(tree.cache, kept.cache):
            assert torch.equal(mine.keys[:, : start + 4], theirs.keys[:, : start + 4]) and torch.equal(mine.values[:, : start + 4], theirs.values[:, : start + 4])
    lm = target_lm(model)
    lm.extend(prompt, num_logits=0)
    for bad in ([(1, 50, -1), (2, 53, 0)], [(1, 50, 0)], [(2, 50, -1), (2, 51, 0), (2, 52, 1)]):  # parent elsewhere, itself, too deep
        with pytest.raises(ValueError, match="branch"):
            lm.extend_branches([40, 41, 42, 43], bad)


def wide_head_target() -> Qwen2ForCausalLM:
    # Head size 128 as in Qwen2.5-1.5B: the gathered block of keys must hold a whole head.
    torch.manual_seed(0)
    config = tiny_config()
    config.head_dim, config.num_attention_heads = 128, 2
    model = Qwen2ForCausalLM(config).eval().requires_grad_(False)
    model.lm_head.weight.mul_(8.0)
    return model


@needs_kernels
def test_keep_branch_leaves_the_cache_a_chain_through_that_token_would_leave():
    model = use_panel_kernels(tiny_target())
    prompt, chain, branches = list(range(3, 17)), [40, 41, 42, 43], [(2, 60, -1), (3, 61, -1)]
    tree = target_lm(model)
    tree.extend(prompt, num_logits=0)
    tree.extend_branches(chain, branches)
    start = len(prompt)
    tree.keep_branch(branch_slot=start + len(chain) + 1, position=start + 3)  # branch (3, 61)
    tree.crop(start + 4)
    assert tree.token_ids == prompt + [40, 41, 42, 61]
    reference = target_lm(model)
    reference.extend(prompt + [40, 41, 42, 61], num_logits=0)
    for mine, theirs in zip(tree.cache, reference.cache):
        assert torch.equal(mine.keys[:, : start + 4], theirs.keys[:, : start + 4])
        assert torch.equal(mine.values[:, : start + 4], theirs.values[:, : start + 4])
    continuation = [70, 71, 72]
    assert torch.equal(tree.extend(continuation, num_logits=3).logits, reference.extend(continuation, num_logits=3).logits)


def test_branch_indices_outside_the_chain_are_refused():
    model = use_panel_kernels(tiny_target()) if panel_kernels_unavailable_reason() is None else tiny_target()
    lm = target_lm(model)
    lm.extend(list(range(3, 10)), num_logits=0)
    if lm.max_branch_rows() == 0:
        with pytest.raises(NotImplementedError, match="no draft trees"):
            lm.extend_branches([40, 41], [(1, 5, -1)])
        return
    with pytest.raises(ValueError, match="branch indices"):
        lm.extend_branches([40, 41], [(0, 5, -1)])
    with pytest.raises(ValueError, match="branch indices"):
        lm.extend_branches([40, 41], [(2, 5, -1)])


def test_pick_and_accept_branches():
    proposal = Proposal(tokens=[7, 8, 9], probs=None, alternatives=[(0, 1, 0.05), (1, 2, 0.3), (2, 3, 0.2), (1, 4, 0.1)])
    assert pick_branches(proposal, 2) == [(2, 2, -1), (3, 3, -1)]  # best scored first, as (row, token, parent)
    assert pick_branches(proposal, 0) == []
    branches = pick_branches(proposal, 4)
    # drafts 7 accepted, 8 rejected: the target's token at row 2 is 4 -> the branch (2, 4), then its row's argmax
    logits = torch.zeros(4 + len(branches), 12)
    logits[0, 7] = logits[1, 4] = logits[4 + branches.index((2, 4, -1)), 11] = 1.0
    assert verify_tree([7, 8, 9], None, logits, branches, SamplingParams(), torch.Generator()) == ([7, 4, 11], 1, [branches.index((2, 4, -1))])
    logits[1, 4], logits[1, 5] = 0.0, 1.0  # no runner-up was the target's token
    assert verify_tree([7, 8, 9], None, logits, branches, SamplingParams(), torch.Generator()) == ([7, 5], 1, [])
    with pytest.raises(ValueError, match="alternatives"):
        Proposal(tokens=[7], probs=None, alternatives=[(0, 7, 0.5)])  # the draft's own token
    with pytest.raises(ValueError, match="alternatives"):
        Proposal(tokens=[7], probs=None, alternatives=[(1, 3, 0.5)])


def test_deeper_trees_pick_best_first_and_follow_kept_paths():
    # Chain 7 8 9; runner-up 1 beside 7 (row 1) continued by 5 (then 6), runner-up 2 beside 8 (row 2).
    proposal = Proposal(
        tokens=[7, 8, 9], probs=None,
        alternatives=[(0, 1, 0.4), (1, 2, 0.1)],
        continuations=[(0, 5, 0.3), (2, 6, 0.05), (0, 3, 0.02)],  # 5 after 1; 6 after 1 5; 3 after 1
    )
    # Best-first: 1 (0.4), 5 after it (0.3), 2 (0.1), then 6 after 5 (0.05); never a child without its parent.
    assert pick_branches(proposal, 4) == [(1, 1, -1), (1, 5, 0), (2, 2, -1), (1, 6, 1)]
    assert pick_branches(proposal, 1) == [(1, 1, -1)]
    branches = pick_branches(proposal, 5)
    # The target rejects 7 for 1, then takes 5 and 6 along the branch rows, then says 13: 4 tokens.
    logits = torch.zeros(4 + len(branches), 16)
    logits[0, 1] = 1.0
    logits[4 + 0, 5] = logits[4 + 1, 6] = logits[4 + 3, 13] = 1.0
    output, num_accepted, kept = verify_tree([7, 8, 9], None, logits, branches, SamplingParams(), torch.Generator())
    assert (output, num_accepted, kept) == ([1, 5, 6, 13], 0, [0, 1, 3])
    # A path no longer than the chain, parents earlier and one token per sibling, or a clear error.
    for continuations in ([(0, 5, 0.3), (1, 6, 0.1), (2, 4, 0.1)], [(1, 5, 0.3)], [(0, 5, 0.3), (0, 5, 0.2)]):
        with pytest.raises(ValueError, match="continuations"):
            Proposal(tokens=[7, 8, 9], probs=None, alternatives=[(0, 1, 0.4)], continuations=continuations)
    # Cutting a proposal at an out-of-vocabulary draft drops the nodes that reach past the cut.
    cut = checked_proposal(Proposal([7, 8, 99], None, 0, [(0, 1, 0.4), (2, 2, 0.1)], [(0, 5, 0.3), (2, 6, 0.1)]), 3, 16, "test")
    assert cut.tokens == [7, 8] and cut.alternatives == [(0, 1, 0.4)] and cut.continuations == [(0, 5, 0.3)]


def test_draft_model_offers_runner_ups_greedy_and_sampling():
    draft = DraftModel(noisy_copy(tiny_target(), noise=0.3), alternatives=2, lean=False)
    prompt = list(range(3, 12))
    greedy = draft.start(prompt, SamplingParams()).propose(DraftContext(prompt), 4, torch.Generator())
    assert len(greedy.alternatives) == 2 * len(greedy.tokens)
    for index, token, score in greedy.alternatives:
        assert token != greedy.tokens[index] and 0 < score <= 1
    # Sampling: the runner-ups are q_draft's best other tokens, none of them cut by top-k.
    sampling = SamplingParams(temperature=1.0, top_k=2)
    sampled = draft.start(prompt, sampling).propose(DraftContext(prompt), 4, torch.Generator().manual_seed(0))
    assert [index for index, _, _ in sampled.alternatives] == list(range(len(sampled.tokens)))  # top-2 leaves one other
    for index, token, score in sampled.alternatives:
        assert token != sampled.tokens[index] and sampled.probs[index, token] > 0 and 0 < score <= 1
    with pytest.raises(ValueError, match="alternatives"):
        DraftModel(tiny_target(), alternatives=-1)
    # Off by default: no runner-ups (and no softmax spent on them) unless trees ask for them.
    assert DraftModel(draft.model).start(prompt, SamplingParams()).propose(DraftContext(prompt), 4, torch.Generator()).alternatives == []


@pytest.mark.parametrize("deeper", [False, True])
def test_sampled_tree_verification_follows_the_target_and_takes_branches(deeper):
    # Two drafts from q_draft, the two best other tokens of q_draft offered beside each (deeper: each
    # first-position runner-up continued by two children). The target: p0 for the first token, then
    # P2[x1] after x1 (a chain row when x1 is the draft, the branch's own row when it is a branch),
    # then `third` whatever came before. The emitted tokens must follow p0, P2[x1] and `third`
    # position by position, whether they came from the chain, a runner-up or a runner-up's child.
    vocab, runs = 6, 6000
    generator = torch.Generator().manual_seed(5)
    sampling = SamplingParams(temperature=1.0)
    p0 = torch.softmax(torch.randn(vocab, generator=generator) * 1.5, -1)
    second = torch.softmax(torch.randn(vocab, vocab, generator=generator) * 1.5, -1)  # [x1, vocab]: P2[x1]
    third = torch.softmax(torch.randn(vocab, generator=generator), -1)
    # The first draft's law: p0 flattened, so the residual after a rejection sits on p0's best
    # tokens, which are q_draft's runner-ups: branches are often taken.
    q_draft = torch.stack([torch.softmax(0.4 * p0.log(), -1), torch.softmax(torch.randn(vocab, generator=generator), -1)])  # [2, vocab]
    first_tokens, pairs, thirds, branch_taken, deep_paths = [], [], [], 0, 0
    for _ in range(runs):
        drafts = torch.multinomial(q_draft, 1, generator=generator)[:, 0].tolist()
        runner_ups = [_best_others(q_draft[index], drafts[index], 2) for index in range(2)]
        branches = [(index + 1, token, -1) for index in range(2) for token in runner_ups[index]]
        if deeper:
            branches += [(1, child, parent) for parent, token in enumerate(runner_ups[0]) for child in second[token].argsort(descending=True)[:2].tolist()]
        # A runner-up at row 1 stands for x1 = token (next: P2[token]); every row after two tokens gives `third`.
        branch_rows = [second[token] if row == 1 and parent < 0 else third for row, token, parent in branches]
        logits = torch.stack([p0, second[drafts[0]], third, *branch_rows]).log()  # [3 + branches, vocab]
        output, num_accepted, kept = verify_tree(drafts, q_draft, logits, branches, sampling, generator)
        assert len(output) == num_accepted + len(kept) + 1 <= 3
        if kept:
            branch_taken += 1
            assert branches[kept[0]][0] == num_accepted + 1 and output[num_accepted] == branches[kept[0]][1]
        deep_paths += len(kept) == 2
        first_tokens.append(output[0])
        if len(output) >= 2:
            pairs.append((output[0], output[1]))
        if len(output) == 3:
            thirds.append(output[2])
    assert branch_taken > runs // 5 and (deep_paths > runs // 20) == deeper
    assert goodness_of_fit_pvalue(torch.bincount(torch.tensor(first_tokens), minlength=vocab).numpy(), p0.numpy()) > SIGNIFICANCE
    observed = torch.zeros(vocab, vocab)
    for x1, x2 in pairs:
        observed[x1, x2] += 1
    expected = observed.sum(1, keepdim=True) * second  # each first token's count times P2[x1]
    assert goodness_of_fit_pvalue(observed.numpy(), expected.numpy()) > SIGNIFICANCE
    assert goodness_of_fit_pvalue(torch.bincount(torch.tensor(thirds), minlength=vocab).numpy(), third.numpy()) > SIGNIFICANCE


def _best_others(probs: torch.Tensor, drafted: int, count: int) -> list[int]:
    return [token for token in probs.argsort(descending=True).tolist() if token != drafted][:count]


def test_runner_ups_exclude_the_drafted_token_under_a_tie():
    # Two logits tie at the top: argmax drafts the first, and the runner-ups must not repeat it
    # whichever order topk ranks the tie in (a repeated draft token is an invalid Proposal).
    session = DraftModelSession(None, SamplingParams(), confidence_threshold=None, alternatives=2)
    token, token_prob, probs, alternatives = session._pick(torch.tensor([0.0, 5.0, 5.0, 1.0, 2.0]), torch.Generator())
    assert (token, token_prob, probs) == (1, 1.0, None)
    assert [alternative for alternative, _ in alternatives] == [2, 4]
    assert alternatives[0][1] == pytest.approx(torch.softmax(torch.tensor([0.0, 5.0, 5.0, 1.0, 2.0]), -1)[2].item())


@needs_kernels
def test_greedy_decoding_with_draft_trees_is_token_identical_and_keeps_branches():
    # A noisy draft: its first choice is often wrong where its second is right, so branches are kept.
    target = use_panel_kernels(tiny_target())
    draft = noisy_copy(tiny_target(), noise=0.25)
    prompt = list(range(3, 12))
    plain = SpeculativeDecoder(target).generate(prompt, max_new_tokens=60, stop=[])
    chains = SpeculativeDecoder(target, DraftModel(draft), gamma=4, tree_rows=0).generate(prompt, max_new_tokens=60, stop=[])
    trees = SpeculativeDecoder(target, DraftModel(draft, alternatives=2), gamma=4, tree_rows=12).generate(prompt, max_new_tokens=60, stop=[])
    assert trees.token_ids == plain.token_ids == chains.token_ids
    assert chains.stats.branches_verified == 0
    assert trees.stats.branches_verified > 0 and trees.stats.branches_accepted > 0
    assert trees.stats.target_calls < chains.stats.target_calls
    for drafted, emitted in zip(trees.stats.drafted_per_round, trees.stats.emitted_per_round):
        assert 1 <= emitted <= drafted + 1  # a kept branch replaces a draft: still 1..gamma+1 tokens a call


def test_tree_rows_is_validated():
    with pytest.raises(ValueError, match="tree_rows"):
        SpeculativeDecoder(tiny_target(), tree_rows=-1)
    for bad in (0, -5, True, 2.0):
        with pytest.raises(ValueError, match="tree_max_context must be an integer >= 1 or None"):
            SpeculativeDecoder(tiny_target(), tree_max_context=bad)


def test_draft_trees_end_where_the_sequence_reaches_tree_max_context():
    target = use_panel_kernels(tiny_target())
    draft = noisy_copy(tiny_target(), noise=0.25)
    prompt = list(range(3, 12))
    limit = len(prompt) + 24
    plain = SpeculativeDecoder(target).generate(prompt, max_new_tokens=60, stop=[]).token_ids
    decoder = SpeculativeDecoder(target, DraftModel(draft, alternatives=2), gamma=4, tree_rows=12, tree_max_context=limit)
    tokens, verified, before_limit = [], 0, 0
    for step in decoder.stream(prompt, 60, stop=[]):
        new_branches, verified = step.stats.branches_verified - verified, step.stats.branches_verified
        if len(prompt) + len(tokens) < limit:  # the round started below the limit: trees allowed
            before_limit += new_branches
        else:
            assert new_branches == 0, f"a tree verified at {len(prompt) + len(tokens)} tokens, limit {limit}"
        tokens += step.token_ids
    assert tokens == plain and before_limit > 0 and len(prompt) + len(tokens) > limit + 8


def test_cli_tree_rows_default_matches_the_engine_and_is_validated(capsys):
    from verispec import cli
    from verispec.engine.decoder import DEFAULT_TREE_ROWS

    assert cli.DEFAULT_TREE_ROWS == DEFAULT_TREE_ROWS
    from verispec.drafters.by_length import DEFAULT_LONG_PROMPT
    from verispec.engine.decoder import LONG_CONTEXT_TREE_LIMIT

    assert (cli.AUTO_TREE_MAX_CONTEXT, cli.DEFAULT_LONG_PROMPT) == (LONG_CONTEXT_TREE_LIMIT, DEFAULT_LONG_PROMPT)
    for bad, message in (("-1", "must be >= 0 (0 = chains only), got -1"), ("x", "must be 'auto' or an integer, got 'x'"), ("8.5", "must be 'auto' or an integer, got '8.5'")):
        with pytest.raises(SystemExit):  # argparse refuses it, naming the option
            cli.main(["generate", "hi", "--tree-rows", bad])
        assert f"--tree-rows: {message}" in capsys.readouterr().err
    assert cli.main(["bench", "--tree-rows", "-1"]) == 2  # bench times what it is told: integers only, chains by default
    assert "--tree-rows must be >= 0" in capsys.readouterr().err
    parser = cli._build_parser()
    assert parser.parse_args(["generate", "hi"]).tree_rows == "auto" and parser.parse_args(["compare"]).tree_rows == "auto"
    assert parser.parse_args(["bench"]).tree_rows == parser.parse_args(["serve"]).tree_rows == DEFAULT_TREE_ROWS
    assert cli.main(["serve", "--tree-rows", "8"]) == 2  # its batched passes verify chains: refused, not ignored
    assert "serve verifies chains only" in capsys.readouterr().err


def test_tree_rows_auto_gives_an_eagle_head_trees_only_where_rows_are_nearly_free(capsys):
    from argparse import Namespace

    from verispec import cli
    from verispec.models.kernel_choice import KernelChoice

    def rows_for(drafter: str, name: str = "panel", eight_rows: float = 1.05, temperature: float | None = 0.0) -> int:
        choice = KernelChoice(name, {"panel": {1: 1.0, 8: eight_rows}, "packed": {1: 1.1, 8: 1.2}})
        return cli._auto_tree_rows(Namespace(drafter=drafter, temperature=temperature), choice)

    assert rows_for("ngram+eagle") == rows_for("eagle") == rows_for("auto") == cli.AUTO_TREE_ROWS == 8  # auto: its EAGLE head's prompts
    assert f"draft trees of 8 rows up to {cli.AUTO_TREE_MAX_CONTEXT} tokens of context" in capsys.readouterr().err
    assert rows_for("eagle", eight_rows=1.3) == 0  # extra rows cost: chains (an AVX2-only EPYC: ~7% a row)
    assert rows_for("eagle", name="packed") == 0  # trees need the panel kernels' fused stack
    assert rows_for("draft-model") == rows_for("ngram+draft") == 0  # its trees measured no faster
    assert rows_for("eagle", temperature=0.7) == 8  # sampled passes verify trees too
    assert KernelChoice("packed").row_cost("panel") is None  # nothing timed: no trees
    assert cli._auto_tree_rows(Namespace(drafter="eagle", temperature=0.0), KernelChoice("panel")) == 0


@pytest.fixture(scope="module")
def target():
    return tiny_target()  # test_eagle's target: its trained_head drafts for this model


@needs_kernels
@pytest.mark.parametrize("expand", [0, 2])
def test_eagle_draft_trees_stay_exact_and_hand_the_head_the_kept_branch_features(target, trained_head, expand, monkeypatch):
    # A kept branch stands where the rejected draft stood: the head must then read the branch
    # row's feature there (not the rejected draft's), or its later drafts condition on a token
    # that is not in the text. Greedy output stays the target's either way, so check the features.
    # expand 2: deeper trees, whose kept paths of several branches must hand over every row.
    from verispec.drafters.eagle import EagleDrafter
    from verispec.engine import decoder as decoder_module

    model = use_panel_kernels(target)
    drafter = EagleDrafter(model, trained_head, alternatives=2, expand=expand)
    kept_paths: list[int] = []  # branches kept per tree round
    verify = decoder_module.verify_tree
    monkeypatch.setattr(decoder_module, "verify_tree", lambda *args: (result := verify(*args), kept_paths.append(len(result[2])))[0])
    handed: dict[int, torch.Tensor] = {}  # position -> the feature the head was handed for it

    class Recording:
        name, needs_target_features = drafter.name, True

        def start(self, prompt_ids, sampling):
            session = drafter.start(prompt_ids, sampling)

            class Session:
                def propose(self, context, max_tokens, generator):
                    if context.target_features is not None:
                        for offset, feature in enumerate(context.target_features):
                            assert context.features_start + offset not in handed, "a position handed twice"
                            handed[context.features_start + offset] = feature.clone()
                    return session.propose(context, max_tokens, generator)

                def close(self):
                    session.close()

            return Session()

    kept = 0
    for prompt in ([5, 6, 7], [40, 41, 42, 43, 44], [90, 3], [12, 13, 60, 61]):
        handed.clear()
        plain = SpeculativeDecoder(model).generate(prompt, max_new_tokens=40, stop=[])
        trees = SpeculativeDecoder(model, Recording(), gamma=4, tree_rows=12).generate(prompt, max_new_tokens=40, stop=[])
        assert trees.token_ids == plain.token_ids
        assert trees.stats.branches_verified > 0
        kept += trees.stats.branches_accepted
        with torch.no_grad():
            truth = target.model(torch.tensor([prompt + trees.token_ids])).last_hidden_state[0]
        assert sorted(handed) == list(range(len(handed)))
        torch.testing.assert_close(torch.stack([handed[i] for i in range(len(handed))]), truth[: len(handed)], atol=1e-4, rtol=1e-4)
    assert kept > 0, "no branch was kept: the test would not see a wrong hand-over"
    assert (max(kept_paths) > 1) == (expand > 0), kept_paths  # deeper trees keep whole runner-up paths
    # Chains only, the head offers no runner-ups (no softmax spent on them).
    chain = EagleDrafter(model, trained_head).start([5, 6, 7], SamplingParams())
    assert chain.propose(DraftContext([5, 6, 7], truth[:2], 0), 3, torch.Generator()).alternatives == []
    # Sampling: q_draft's best other tokens, none outside its top-k.
    sampled = drafter.start([5, 6, 7], SamplingParams(temperature=0.8, top_k=3)).propose(DraftContext([5, 6, 7], truth[:2], 0), 3, torch.Generator().manual_seed(1))
    assert [index for index, _, _ in sampled.alternatives] == [index for index in range(len(sampled.tokens)) for _ in range(2)]
    for index, token, score in sampled.alternatives:
        assert token != sampled.tokens[index] and sampled.probs[index, token] > 0 and 0 < score <= 1
    with pytest.raises(ValueError, match="alternatives"):
        EagleDrafter(model, trained_head, alternatives=-1)


def test_eagle_tree_continuations_are_what_the_head_predicts_after_their_path(target, trained_head):
    # Each continuation must be one of the head's two best tokens after its whole path, fed as a
    # cached chain would feed it (the runner-up at its draft's position, then each child one on),
    # scored by the path's probability; no path longer than the chain; the chain is the one-level
    # round's chain (the tree rides along, it does not change the drafts).
    from verispec.drafters.eagle import EagleDrafter

    prompt = [5, 6, 7, 8, 9, 10]
    with torch.no_grad():
        truth = target.model(torch.tensor([prompt])).last_hidden_state[0]
    context = DraftContext(prompt, truth[:-1], 0)
    deep = EagleDrafter(target, trained_head, alternatives=2, expand=3)
    one_level = EagleDrafter(target, trained_head, alternatives=2).start(prompt, SamplingParams()).propose(context, 5, torch.Generator())
    session = deep.start(prompt, SamplingParams())
    proposal = session.propose(context, 5, torch.Generator())
    assert proposal.tokens == one_level.tokens
    assert [entry[:2] for entry in proposal.alternatives] == [entry[:2] for entry in one_level.alternatives]
    assert [entry[2] for entry in proposal.alternatives] == pytest.approx([entry[2] for entry in one_level.alternatives], rel=1e-4)
    assert proposal.continuations and len(proposal.tokens) >= 2
    nodes = [(index, [token], score) for index, token, score in proposal.alternatives]  # (draft index it leaves at, path, score)
    for parent, token, score in proposal.continuations:
        index, path, parent_score = nodes[parent]
        nodes.append((index, path + [token], score))
        assert index + len(path) < len(proposal.tokens) and 0 < score <= parent_score
        # The head fed the chain up to the branch point, then the path: its top-2 after the path.
        real = session.num_real
        features, cache = session.next_feature, session.cache
        with torch.inference_mode():  # as drafting runs (the session's cache holds inference tensors)
            for fed in proposal.tokens[:index] + path:
                features = deep.head(features[None, None], deep.embed(torch.tensor([[fed]])).float(), start=cache.length, cache=cache)[0, 0]
            probs = torch.softmax(deep.draft_logits(features[None])[0], -1)
        cache.crop(real)
        best = probs.topk(2)
        assert token in best.indices.tolist()
        assert score == pytest.approx(parent_score * float(probs[token]), rel=1e-3)
    with pytest.raises(ValueError, match="expand"):
        EagleDrafter(target, trained_head, expand=-1)


@needs_kernels
@pytest.mark.parametrize("correction", [False, True])
def test_parallel_draft_trees_stay_exact_and_keep_branches(target, trained_head, correction):
    from verispec.drafters.parallel import ParallelConfig, ParallelDrafter, ParallelHead

    model = use_panel_kernels(target)
    torch.manual_seed(3)
    head = ParallelHead(ParallelConfig.for_target(target.config, trained_head.config.intermediate_size, block_size=3, first_from_anchor=True))
    head.load_eagle(trained_head)  # its first draft and runner-ups are the trained EAGLE head's
    drafter = ParallelDrafter(model, head.eval().requires_grad_(False), candidates=3, correction=correction, alternatives=2)
    kept = 0
    for prompt in ([5, 6, 7], [40, 41, 42, 43, 44], [90, 3], [12, 13, 60, 61]):
        plain = SpeculativeDecoder(model).generate(prompt, max_new_tokens=40, stop=[])
        trees = SpeculativeDecoder(model, drafter, gamma=3, tree_rows=10).generate(prompt, max_new_tokens=40, stop=[])
        assert trees.token_ids == plain.token_ids and trees.stats.branches_verified > 0
        kept += trees.stats.branches_accepted
    assert kept > 0


def test_parallel_runner_ups_are_the_other_candidates_scored_by_their_path(target):
    from verispec.drafters.parallel import ParallelConfig, ParallelDrafter, ParallelHead
    from verispec.drafters.parallel.drafter import BlockDrafts, path_runner_ups

    log_probs = torch.log(torch.tensor([[[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]]]))  # [1, 2 positions, 3 candidates]
    drafts = BlockDrafts(torch.tensor([[10, 21]]), torch.tensor([2]), 2, torch.tensor([2]), log_probs, torch.tensor([[[10, 11, 12], [20, 21, 22]]]), torch.tensor([[0, 1]]))
    alternatives = path_runner_ups(drafts, 0, 2)
    assert [(i, token) for i, token, _ in alternatives] == [(0, 11), (0, 12), (1, 20), (1, 22)]
    assert [score for *_, score in alternatives] == pytest.approx([0.3, 0.2, 0.5 * 0.6, 0.5 * 0.1])
    assert path_runner_ups(drafts, 0, 0) == []
    # A path the stop rule ended after its first draft offers runner-ups there only.
    drafts.lengths[0] = 1
    assert [(i, token) for i, token, _ in path_runner_ups(drafts, 0, 2)] == [(0, 11), (0, 12)]
    # Greedy and sampling sessions offer them (the path is a deterministic draft either way); bad counts are refused.
    head = ParallelHead(ParallelConfig.for_target(target.config, 24, block_size=3)).eval().requires_grad_(False)
    drafter = ParallelDrafter(target, head, candidates=1, correction=False, alternatives=2)
    with torch.no_grad():
        features = target.model(torch.tensor([[5, 6, 7]])).last_hidden_state[0]
    context = DraftContext([5, 6, 7], features[:2], 0)
    greedy = drafter.start([5, 6, 7], SamplingParams()).propose(context, 3, torch.Generator())
    assert len(greedy.alternatives) == 2 * len(greedy.tokens) == 6
    sampled = drafter.start([5, 6, 7], SamplingParams(temperature=1.0)).propose(context, 3, torch.Generator())
    assert sampled.probs is None and len(sampled.alternatives) == 2 * len(sampled.tokens) == 6
    with pytest.raises(ValueError, match="alternatives"):
        ParallelDrafter(target, head, alternatives=-1)
