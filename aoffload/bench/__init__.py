"""``python -m aoffload.bench``: aoffload measured side by side with the systems it replaces.

Figures are medians of several repetitions (warm-up excluded) with min and max; ratios
are taken between figures measured in the same run, since absolute times drift on a
shared machine.
"""
