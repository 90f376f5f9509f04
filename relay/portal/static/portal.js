// The portal's one script: a link's token arrives in the URL's fragment (#token=…), which no
// server sees; it is taken out of the address bar at once and posted to the portal, which
// answers with a session cookie. Without it, the page offers a field to paste the token.
(function () {
  "use strict";
  var match = /(?:^#|&)token=([^&]+)/.exec(window.location.hash);
  if (!match) { return; }
  history.replaceState(null, "", window.location.pathname + window.location.search);
  function send() {
    var form = document.getElementById("sign-in");
    if (!form) { return; }
    form.elements.token.value = decodeURIComponent(match[1]);
    var opening = document.getElementById("opening");
    if (opening) { opening.hidden = false; }
    form.submit();
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", send);
  } else {
    send();
  }
})();
