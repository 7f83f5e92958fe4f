"""The status page served at `/`: one self-contained HTML document, no scripts, no external assets.

Built from the /status document (`status.document.status_document`), plus two things the
document does not carry: how many servers each backend has in the configs HAProxy runs (so a
drain reads "b42: 3 of 10 dead"), and the bounded history behind the charts (State keeps it).
Every value is escaped. At fleet size (10,000 servers, 1,000 dead, 50 old workers) the dead
and steered servers are shown per backend, worst first, so every affected backend is on the
page; the server names are in each backend's tooltip and in /status.

The package, one idea a module:
- `damage`: dead servers grouped by backend, worst first, and the backends' sizes; pure.
- `charts`: the inline SVG charts of reloads, pushes and old workers over time; pure.
- `markup`: the escaping and the small HTML pieces the others share.
- `render`: the page itself (`render_page`, and `page_of` for the daemon).
"""
