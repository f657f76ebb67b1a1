// Renders the math arithmatex marks (pymdownx.arithmatex, generic mode) with KaTeX, on every page load (Material's
// instant navigation included). The KaTeX files come from a CDN when a page is viewed; the build needs no network.
document$.subscribe(({ body }) => {
  renderMathInElement(body, {
    delimiters: [
      { left: "$$", right: "$$", display: true },
      { left: "$", right: "$", display: false },
      { left: "\\(", right: "\\)", display: false },
      { left: "\\[", right: "\\]", display: true },
    ],
  });
});
