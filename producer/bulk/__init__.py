"""Bulk offline processing: OpenAI Batch JSONL, or documents with a task, run through the
queue by Celery tasks (validate, split, enqueue, gather, reduce, finalize).

    inputs.py    parse and validate input lines into requests or error lines
    plan.py      tasks' prompts, token-bounded chunks, the map-reduce plan (also offline)
    store.py     the batch record, line progress and per-line results in Redis
    validate.py  a batch's first step: its lines parsed into requests or error lines
    drive.py     one pass of a running batch: submit, gather, reduce, record lines
    finalize.py  the output and error JSONL files
    tasks.py     the Celery tasks (step, maintain) and resume on worker start
    manage.py    what the CLI does: create, cancel, read a batch
    progress.py  the live progress view
"""
