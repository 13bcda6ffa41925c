"""Policies: loading them (the embedded SmolLM2, hub ids, folders, LoRA adapters; `loading`),
prompting and sampling (`generation`), sequence log-probabilities, KL and perplexity
(`logprobs`), ILHF's LoRA particle ensembles (`ensemble`), and every policy of a run by name
(`policies`).
"""
