"""The routing policies a suite compares (``eval_policies``) and the external routers among
them: SGLang's model gateway (``eval_gateway``, ``gateway_client``, ``token_text``) and NVIDIA
Dynamo's KV router (``eval_dynamo``, ``dynamo_client``, ``kv_event_relay``)."""
