// almanac dashboard: reload pages that ask for it (body[data-refresh], in
// seconds) unless the reader turned auto-refresh off or is typing in a
// form (a pause note). Nothing else.
(function () {
  var body = document.body;
  var seconds = Number(body.getAttribute("data-refresh"));
  var button = document.getElementById("refresh-toggle");
  if (!seconds || !button) return;
  var key = "almanac-refresh";
  function on() { return localStorage.getItem(key) !== "off"; }
  function show() {
    button.textContent = on() ? "auto-refresh: on" : "auto-refresh: off";
    button.classList.toggle("off", !on());
  }
  button.addEventListener("click", function () {
    localStorage.setItem(key, on() ? "off" : "on");
    show();
  });
  show();
  setInterval(function () {
    var typing = document.activeElement && document.activeElement.form;
    if (on() && !document.hidden && !typing) location.reload();
  }, seconds * 1000);
})();
