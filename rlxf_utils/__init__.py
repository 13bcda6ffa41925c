"""rlxf_utils: the tested logic behind the RLXF study's notebooks (data, reward, RL, evaluation, report)."""

__version__ = "0.1.0"
