"""Bring your own model: user-style DeepSpeed pipeline scripts run on stock DeepSpeed and on ds_recycle.

- ``models.py``: small ``PipelineModule``s and their datasets (AlexNet-style convnet, tied GPT, tuple-boundary
  GPT, dropout MLP); ``user_train.py``: the training script a DeepSpeed user writes; ``configs/``: its
  DeepSpeed configs (fp32 and bf16, 2 stages x 2 pipelines on 4 processes);
- ``harness.py``: the one-line ds_recycle variant of a script, runs under torchrun, ``deepspeed`` and
  ``ds-recycle launch``, and comparison of final parameters; ``site/sitecustomize.py``: put on
  ``PYTHONPATH`` by the harness so DeepSpeed skips its CPU shared-memory op build;
- ``test_vanilla_scripts.py`` (stock DeepSpeed), ``test_recycle_scripts.py`` (the variant, failure-free and
  with a SIGKILLed worker), ``test_harness.py``.

By hand::

    cd tests/byom && PYTHONPATH=site DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 \\
        python -m torch.distributed.run --standalone --nproc_per_node 4 user_train.py \\
        --deepspeed_config configs/fp32.json --model tuple --steps 20 --save-final /tmp/final.pt
"""
