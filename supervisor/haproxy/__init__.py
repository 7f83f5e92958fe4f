"""Everything that knows HAProxy's config language and CLI."""
