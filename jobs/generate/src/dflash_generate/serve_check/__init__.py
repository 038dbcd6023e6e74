"""`dflash-generate serve-check`: the exported drafter in the real engine, against the offline evaluation.

Reads the offline evaluation (`dflash-train evaluate`: its manifest, and `evaluation.json` with the exact
prompt token ids, budget, stop ids, block size and dtype it used) and the export it names, then starts
vLLM on the target twice, at the SAME dtype, on the same prompts (by default the held-out split of the
run's tokenized data, which training never read; the committed manifest keeps the offline `prompt_split`):
1. with `speculative_config={"method": "dflash", "model": EXPORT, "num_speculative_tokens": B - 1}`,
   generating greedily on the same prompts; acceptance is read from the engine's own counters
   (`vllm:spec_decode_num_drafts`, `_num_draft_tokens`, `_num_accepted_tokens`,
   `_num_accepted_tokens_per_pos`, as deltas over this generation): engine tau = 1 + accepted / drafts;
2. without speculation, on the same prompts. Both runs return their top log-probabilities per token, and the
   outputs are held to the numerics policy of `dflash_shared.lossless` (the one the offline evaluation uses):
   token for token in float32; in bfloat16 a parting is a rounding flip only where BOTH runs show a near-tie in
   their own log-probabilities (each run's token its own best, the other's within `tie_margin` nats). Past such
   a parting the comparison goes on teacher-forced: the speculative engine is asked again with the plain run's
   prefix up to and including its token, so every later position is compared too; at most
   `max_near_tie_share` of the plain run's near-tie positions (its own top two within `tie_margin`) may part.
   A failure names prompt, position, both tokens and both margins.

The engine runs at the offline evaluation's dtype unless this vLLM build runs the target in one dtype only:
vLLM's CPU build runs hybrid (Gated DeltaNet) targets in bfloat16 only, while an offline evaluation on CPU
is float32, the dtype at which the offline loop is lossless (in bfloat16 its block-parallel verification and
the target's token-by-token greedy decoding round differently and can part on a near tie). Then the engine
runs bfloat16, the report records both dtypes, and the two sides may decode some prompts differently (a tie
rounded the other way sends a prompt down another path, with other acceptance). The gap is then taken over the
prompts the engine decoded exactly as the offline loop did (per-request acceptance from the engine), which
must be at least `min_matched_fraction` of them; the gap over all prompts is reported beside it.

Acceptance is also compared prompt by prompt and step by step (serve_steps.py): every prompt the engine decoded
exactly as the offline loop did is replayed against the offline trace (`evaluation.json`, `results[i].accepted`)
with vLLM's per-request trace (`per_step_accepted`, `per_step_drafted`), and the first step that differs is named
(prompt, step, position, both counts). More than `max_step_mismatch_fraction` of the steps differing fails the
run: a drafter served with other weights on some layers can keep the averaged gap small.

A relative gap |engine tau - offline tau| / offline tau above the tolerance means training and serving
disagree (layer ids, masks, positions, template) and fails the run with BadInputError (exit 65), as do
differing outputs and differing steps. `<output>/serve-check.json` is written first; the evaluation manifest
(offline numbers plus engine_tau) is written last, only when every check passes. A DFlash engine starts only
where vLLM will run the context-key norm self-test in its engine processes (context_k_norm.py).
"""

# The parts, each importable alone: config.py (the settings, torch- and vLLM-free: the pipeline imports it),
# report.py (serve-check.json and the judgments over it), engine_passes.py (vLLM started and driven),
# stage.py (inputs, run, commit, the command).
