"""The parse-time side of the workflow, importable without torch (Snakemake reads it while it
parses, before any job): the config's schema and defaults (``schema``), its checks against models
and data (``validate``, ``checks``, ``sources``), what runs (``plan``) and the typed settings each
step reads (``settings``). Used by workflow/rules/common.smk and every step.
"""
