"""Task worlds with exact checkers: procedural scenes, the prompts that describe them, and the code that grades an
image against a prompt. Pure NumPy (layer 1, beside `sampling/`): models, rewards and the trainer build on them.

    shapes  a GenEval-style world of coloured circles, squares and triangles (`omniroll.tasks.shapes`)
"""
