"""KV groups: a sliding layer keeps only its window's pages (``core/kv_groups.py``).

The grouping of GPT-OSS's, Gemma 3's and one-type models' layers; then, on a tiny model of
a sliding and a full layer (Qwen3's ``layer_types``), an engine whose sliding group drops
the pages out of its window: greedy tokens past the window equal transformers', the pool's
peak stays at the window's pages, and groups sharing a prompt, preemption, a prefix-cache
hit beyond the window, a held completion continued, sleep and wake, and TP=2 give the
tokens of an engine that never drops a page (its windows never cut: max_model_len within
the window changes nothing below it) or of a roomy pool. The block manager's accounting
under random operations is ``test_block_manager.py``'s state machine, with groups.
"""

from __future__ import annotations

from tandem.rollout import LLM, Continuation, SamplingParams
from tandem.rollout.core.kv_groups import kv_groups, single_group, window_pages

from .test_models import hf_greedy
from .test_sliding_window import PROMPTS, WINDOW, reference, window_dir  # noqa: F401

BLOCK = 4
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def test_gpt_oss_layers_alternate_in_two_groups_of_twelve():
    windows = [128 if layer % 2 == 0 else None for layer in range(24)]
    groups = kv_groups(windows, 4096)
    assert groups.windows == (None, 128) and groups.rows == 12
    assert groups.group_of == tuple(1 - layer % 2 for layer in range(24))
    assert groups.row_of == tuple(layer // 2 for layer in range(24))
    # at 4k tokens: 256 pages of the full group, 10 of the sliding one (at 16 tokens a page)
    assert groups.pages_for(4096, 16) == 256 + window_pages(128, 16) == 266


def test_gemma3_five_sliding_to_one_full_take_a_full_group_and_six_sliding_ones():
    windows = [None if (layer + 1) % 6 == 0 else 512 for layer in range(26)]
    groups = kv_groups(windows, 8192)
    assert groups.rows == 4 and groups.windows == (None,) + (512,) * 6  # 22 sliding in 24 rows
    assert sorted(zip(groups.group_of, groups.row_of)) == sorted(
        {(g, r) for g in range(7) for r in range(4)} - {(6, 2), (6, 3)})


def test_windows_that_never_cut_keep_one_group_and_every_layer_sliding_one_sliding_group():
    alternating = [8, None, 8, None]
    assert kv_groups(alternating, 8) == single_group(4)  # no context passes the window
    assert kv_groups(alternating, 9).windows == (None, 8)
    every = kv_groups([8] * 4, 4096)  # Mistral, Phi-3: group 0 slides
    assert every.windows == (8,) and every.rows == 4


def sliding_llm(path, **options) -> LLM:
    return LLM(str(path), max_model_len=128, block_size=BLOCK, **options)


def test_the_sliding_group_holds_its_window_and_tokens_match_transformers(window_dir):  # noqa: F811
    path = window_dir("qwen3")
    llm = sliding_llm(path, num_kv_blocks=120)
    assert llm.engine.kv_groups.windows == (None, WINDOW)
    prompt = PROMPTS[0]
    output = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert output == hf_greedy(reference(path), prompt, 40)
    stats = llm.stats()
    num_blocks = -(-(len(prompt) + 40) // BLOCK)  # the full group's pages at the end
    # at its peak the full group's pages and the sliding group's window (the prompt's
    # sliding pages, all allocated on admission, are dropped by then)
    assert stats["kv_blocks_used_peak"] <= num_blocks + window_pages(WINDOW, BLOCK)
    assert stats["kv_blocks_used_peak"] < 2 * num_blocks  # what holding the context takes
    assert stats["kv_blocks_used"] == 0


def test_groups_preemption_and_a_cached_prefix_keep_the_tokens_of_a_roomy_pool(window_dir):  # noqa: F811
    path = window_dir("qwen3")
    params = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=7, n=3)
    roomy = sliding_llm(path, num_kv_blocks=400)
    tight = sliding_llm(path, num_kv_blocks=70, max_num_batched_tokens=16)

    def run(llm: LLM) -> list[list[int]]:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        return [c.token_ids for o in outputs for c in o.outputs]

    expected = run(roomy)
    assert run(tight) == expected
    assert tight.stats()["preemptions"] > 0 and tight.stats()["cow_copies"] > 0
    # Again: the prompts' blocks hit the prefix cache, their pages beyond the window alive
    # or the hit cut where one was dropped and evicted.
    before = tight.stats()["prefix_cache_hit_tokens"]
    assert run(tight) == expected
    assert tight.stats()["prefix_cache_hit_tokens"] > before


def test_a_held_completion_continues_past_the_window_as_a_fresh_prefill(window_dir):  # noqa: F811
    path = window_dir("qwen3")
    llm = sliding_llm(path, num_kv_blocks=120)
    fresh = sliding_llm(path, num_kv_blocks=120, enable_prefix_caching=False)
    first = llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False, hold_kv=True)[0]
    env = [7, 8, 9]
    second = llm.generate(Continuation(first.request_id, 0, env), GREEDY, use_tqdm=False)[0]
    conversation = PROMPTS[1] + first.outputs[0].token_ids + env
    assert second.outputs[0].token_ids == \
        fresh.generate([conversation], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.stats()["kv_blocks_used"] == 0


def test_every_layer_sliding_keeps_a_window_and_matches_transformers(window_dir):  # noqa: F811
    # Mistral's layers all slide: group 0 drops pages too; a prefix-cache hit past the
    # window takes only the window's blocks.
    path = window_dir("mistral")
    llm = sliding_llm(path, num_kv_blocks=60)
    assert llm.engine.kv_groups.windows == (WINDOW,)
    prompt = PROMPTS[0]
    hf_model = reference(path)
    for _ in range(2):  # the second prompt hits the cache beyond the window
        output = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert output == hf_greedy(hf_model, prompt, 40)
    stats = llm.stats()
    assert stats["prefix_cache_hit_tokens"] >= len(prompt) - BLOCK - 1
    assert stats["kv_blocks_used_peak"] <= -(-len(prompt) // BLOCK) + 1  # the prompt's
    assert stats["kv_blocks_used"] == 0


def test_sleep_and_wake_then_tp2_give_the_same_tokens(window_dir):  # noqa: F811
    path = window_dir("qwen3")
    llm = sliding_llm(path, num_kv_blocks=120)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm.sleep(1)
    llm.wake_up()
    assert [o.outputs[0].token_ids
            for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    tp2 = sliding_llm(path, num_kv_blocks=120, tensor_parallel_size=2)
    assert [o.outputs[0].token_ids
            for o in tp2.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
