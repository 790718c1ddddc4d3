"""What a tenant may send to `/v1/completions` and `/v1/chat/completions`, and what comes back.

vLLM's OpenAI server takes, next to OpenAI's fields, settings meant for whoever runs the engine:
`priority` jumps other tenants' queues on a node with priority scheduling, `request_id` names the request
in the engine and in its answer, `kv_transfer_params` and `vllm_xargs` reach connectors and plugins,
`chat_template` runs the tenant's Jinja on the node, `prompt_embeds` hands it tensors to decode, and an
`image_url` part has it fetch a URL. So the gateway forwards an allow-list: each endpoint's fields
(fields.py), each with a check of its type (checks.py) and, where a plan field bounds it (`GatewayPlan`),
of its value; a chat request that names no token bound gets the plan's. Any other field is refused with
400 `unsupported_parameter` naming it rather than dropped, so that a tenant learns its setting would have
had no effect. docs/gateway.md, "Request fields", says
the same for people.

Answers are narrowed the other way (answers.py): completion, chat completion and chunk objects keep
OpenAI's fields, `system_fingerprint` always null (it would tell engine builds apart); vLLM's extras go.

The work is linear in the body, which the gateway bounded in bytes before parsing it; nothing here
compiles, fetches or decodes what a tenant sent (structured-output constraints are only measured).
"""
