"""MONA, from a file to what every later stage reads (notebook 01).

`schema` (the known vintages' columns and status codes), `read` (decoding and parsing a CSV or
.xlsx file), `labels` (statuses to MET / Non-MET, dates, test years), `mona` (`load_mona`: one
clean table), `splits` (the three protocols and the nested evaluation holdout), `contexts` (the
prompt contexts, and the rows SFT and RL may see), `stage` (notebook 01: writes `data/` and the
descriptive tables).
"""
