// make read: keep a step's code in view while its doc scrolls, when the code fits the screen.
(function () {
  "use strict";
  function stick() {
    var room = window.innerHeight - 80;
    var wide = window.matchMedia("(min-width: 901px)").matches;
    document.querySelectorAll(".row > .code > figure.codebox").forEach(function (box) {
      var cell = box.parentElement;
      box.classList.toggle("stick", wide && box.offsetHeight < room && cell.offsetHeight > box.offsetHeight + 40);
    });
  }
  window.addEventListener("load", stick);
  window.addEventListener("resize", stick);
})();
