"""`sous route`: the llm-d router (endpoint picker and P/D sidecar) over `sous serve`s."""
