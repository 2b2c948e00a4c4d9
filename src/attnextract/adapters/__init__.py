"""Black-box adapters and transport: Python files, torch modules, MiniLM heads, HTTP
servers and clients, and the query journal."""
