"""tokenmill-conformance: certifies a tokenmill platform plugin.

Run `tokenmill-conformance --platform NAME --report cert.json`, or pytest directly:
`pytest --pyargs tokenmill_conformance.suite --tokenmill-platform NAME`. The tiers, the
rules and the certificate are described in docs/vendor-guide.md and
docs/certificate-schema.md.
"""

__version__ = "0.1.0"
