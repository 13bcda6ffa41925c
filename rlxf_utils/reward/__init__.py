"""The reward model learned from MONA's outcomes (notebook 02).

`encoders` (the embedded encoders' weights), `model` (`RewardModel`: scoring, saving, loading),
`training` (fine-tuning an encoder), `calibration` (metrics, ECE, Platt scaling), `tfidf` (the
TF-IDF model: baseline and audit), `protocol` (one split protocol end to end, reusable),
`statistics` (the protocols' bootstrap intervals and comparisons), `tables` and `figures`
(notebook 02's), `bundle` (the reward RL optimises and its audit), `uncertainty` (bootstrap
heads: the SD of P(MET) per response), `forensic` (the arm that reads what the paper forbids;
never feeds RL), `stage` (notebook 02).
"""
