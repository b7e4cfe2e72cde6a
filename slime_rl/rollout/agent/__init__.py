"""Agents that speak OpenAI's chat API, trained on the exact tokens the engine produced.

- `trajectory.Trajectory`: one agent run as one training sample (prompt = the first request's rendering;
  model tokens as sampled; tool results and user turns as environment tokens, taken from the chat
  template's rendering of only the new messages; a conversation that does not extend the last one branches).
- `endpoint.AgentEndpoint`: `/v1/chat/completions` and `/v1/models` on 127.0.0.1, one base URL per trajectory.
- `runner.AgentGenerate`: `--custom-generate-function-path` naming `async def agent(client, sample)`.
- `toolcalls`: tool calls in Qwen/Hermes syntax to OpenAI's `tool_calls`, and back for the template.
"""
