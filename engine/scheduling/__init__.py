"""Scheduling: which requests compute how many tokens each step, their page tables, prefix lookup and admission."""
