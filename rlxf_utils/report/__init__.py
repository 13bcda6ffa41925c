"""Every sentence a reader sees, and the working paper that holds them.

`wording` (numbers, intervals, p-values and the verdict vocabulary: the one place they are
formatted; importable by every stage), `data`, `reward`, `forensic`, `rl`, `evaluation`, `rlgf`,
`ilhf`, `risk` (each section's sentences and variables, read from the run directory), `render`
(the report's sources and their rendering with Quarto, or pandoc and Typst). This file imports
nothing, so stages below the report can use its wording.
"""
