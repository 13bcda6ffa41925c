"""Evaluating every policy on held-out prompts (notebook 04).

`sampling` (responses and their scores), `measures` (text and area-distribution measures),
`best_of_n` (the selection, its KL bound, the curve, RL against best-of-N at equal KL),
`grounding` (nearest historical conditions), `history` (history as policies), `tables` (the
summary, KL, the frontier, held-out perplexity, Table 3), `figures`, `rlgf` and `ilhf` (the
companion papers' analyses), `stage` (notebook 04).
"""
