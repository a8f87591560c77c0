"""Inspection tools: SASS counts, Nsight Compute launches and summaries, op counts, decode profiles."""
