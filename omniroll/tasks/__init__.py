"""Task worlds with exact checkers: procedural scenes, the prompts that describe them, and the code that grades an
image or a video against a prompt. Pure NumPy (layer 1, beside `sampling/`): models, rewards and the trainer build on
them.

    shapes         a GenEval-style world of coloured circles, squares and triangles (`omniroll.tasks.shapes`)
    moving_shapes  its video counterpart: clips where the shapes move, appear in order or change colour, checked by
                   per-frame detection and tracking (`omniroll.tasks.moving_shapes`)
"""
