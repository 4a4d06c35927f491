"""What each job costs and asks for, before it runs (pure standard library: Snakemake imports it
while it parses the workflow, so no module here may import torch).

- ``model``: the fitted cost model (memory and seconds per stage, from a model's config.json);
- ``training``: a sparse copy's post-training job, composed from the fit's training step;
- ``requests``: each GPU rule's ``mem_mb`` and ``runtime`` from those estimates;
- ``budget``: what the planned jobs hold on a card, and the refusal of a plan that cannot fit it;
- ``defaults``: a job's requests where the fit has no estimate.
"""
