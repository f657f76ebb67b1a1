"""Bridges to other RL frameworks. Each is an optional extra; `import omniroll` imports none of them."""
