"""The least a training script on areal's worker runtime does: join the job, load the model
the servers serve, align them with it, sample, close. Start servers, then:

    areal train --alloc fsdp:d2 -- -m areal_cli.templates.examples.worker_min
"""

from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_cli.worker import align_servers, close, connect, shard_model

ctx = connect()  # rank, mesh and the servers `areal train` found
client = ctx.rollout_client()
model_path = client.run(client.model_info())["model_path"]  # what the servers loaded
tokenizer = AutoTokenizer.from_pretrained(model_path)
model = shard_model(AutoModelForCausalLM.from_pretrained(model_path), ctx.mesh)
align_servers(model, client, model_path)  # the servers hold these weights before sampling
prompts = [tokenizer.encode(f"{a} + {a} =", add_special_tokens=False) for a in range(4)]
groups = client.run(client.generate_batch(prompts, n=2, max_new_tokens=8))
for prompt, group in zip(prompts, groups, strict=True):
    samples = [tokenizer.decode(c.output_ids) for c in group]
    print(f"rank {ctx.rank}: {tokenizer.decode(prompt)!r} -> {samples}", flush=True)
client.close_sync()  # its HTTP session and what it holds on the servers
close()  # the process group, on every rank
