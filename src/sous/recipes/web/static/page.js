/* The recipe page. It composes nothing: every command, script and fit verdict is looked up
   in window.SOUS_RECIPE_DATA (built by sous.recipes.web.bundle) by the selection's key,
   `axis=value&...` in the grid's axis order. State lives in the URL hash
   (#recipe=..&strategy=..&target=..&lang=..&<axis>=<value>..), so a link keeps the selection. */
(function () {
  "use strict";
  var DATA = window.SOUS_RECIPE_DATA;
  var I18N = window.SOUS_I18N;
  var state = { recipe: null, strategy: null, target: null, sel: {}, lang: "en", notice: "" };
  var byId = function (id) { return document.getElementById(id); };

  function t(key, vars) {
    var table = I18N[state.lang] || I18N.en;
    var s = key in table ? table[key] : (key in I18N.en ? I18N.en[key] : key);
    return s.replace(/\{(\w+)\}/g, function (m, k) { return vars && k in vars ? vars[k] : m; });
  }

  function el(tag, attrs) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) {
      var v = attrs[k];
      if (v === null || v === undefined || v === false) return;
      if (k === "text") node.textContent = v;
      else if (k === "on") Object.keys(v).forEach(function (e) { node.addEventListener(e, v[e]); });
      else if (k in node && k !== "list" && typeof v !== "string") node[k] = v;
      else node.setAttribute(k === "cls" ? "class" : k, v === true ? "" : v);
    });
    for (var i = 2; i < arguments.length; i++) {
      var c = arguments[i];
      if (c !== null && c !== undefined) node.append(c);
    }
    return node;
  }

  var ALLOWED = ["CODE", "STRONG", "EM", "B", "I", "BR", "SPAN", "A", "P", "UL", "OL", "LI"];

  function clean(node) {
    Array.prototype.slice.call(node.childNodes).forEach(function (child) {
      if (child.nodeType === 3) return;
      if (child.nodeType !== 1 || child.tagName === "SCRIPT" || child.tagName === "STYLE") {
        child.remove();
        return;
      }
      clean(child);
      if (ALLOWED.indexOf(child.tagName) < 0) {
        child.replaceWith.apply(child, Array.prototype.slice.call(child.childNodes));
        return;
      }
      Array.prototype.slice.call(child.attributes).forEach(function (a) {
        var keep = child.tagName === "A" && a.name === "href" && /^https?:\/\//.test(a.value);
        if (!keep) child.removeAttribute(a.name);
      });
      if (child.tagName === "A") { child.rel = "noopener noreferrer"; child.target = "_blank"; }
    });
  }

  /* A recipe's page copy (an HTML fragment) with only harmless tags kept. */
  function fragment(html) {
    var tpl = document.createElement("template");
    tpl.innerHTML = html || "";
    clean(tpl.content);
    return tpl.content;
  }

  function recipe() { return DATA.recipes.filter(function (r) { return r.id === state.recipe; })[0]; }
  function strategy() {
    return recipe().strategies.filter(function (s) { return s.slug === state.strategy; })[0];
  }
  function option() {
    return strategy().options.filter(function (o) { return o.target === state.target; })[0];
  }
  function keyOf(opt, sel) {
    return opt.axes.map(function (a) { return a.axis + "=" + sel[a.axis]; }).join("&");
  }
  function entryOf(opt, sel) { return opt.selections[keyOf(opt, sel)]; }
  function allowed(opt, sel) {
    var e = entryOf(opt, sel);
    return e !== undefined && !(typeof e === "object" && "x" in e);
  }
  function copy(obj) { return JSON.parse(JSON.stringify(obj)); }
  function pageText() {
    var r = recipe();
    return r.text[state.lang] || r.text.en || r.text[Object.keys(r.text)[0]] || {};
  }
  function axisTitle(axis) {
    var own = recipe().axisLabels[axis];
    var known = "axis_" + axis in (I18N[state.lang] || {});
    if (state.lang !== "en" && known) return t("axis_" + axis);
    return own ? own.title : (known ? t("axis_" + axis) : axis);
  }
  function valueLabel(axis, value) {
    var own = recipe().axisLabels[axis];
    if (own && own.values[value]) return own.values[value];
    return value === "on" || value === "off" ? t(value) : value;
  }

  /* ---------------------------------------------------------------- state and URL */

  function pickSelection(opt, wanted) {
    var sel = copy(opt.initial);
    opt.axes.forEach(function (a) {
      if (wanted && a.values.indexOf(wanted[a.axis]) >= 0) sel[a.axis] = wanted[a.axis];
    });
    return allowed(opt, sel) ? sel : null;
  }

  function setPlace(recipeId, slug, target, wanted) {
    var r = DATA.recipes.filter(function (x) { return x.id === recipeId; })[0] || DATA.recipes[0];
    state.recipe = r.id;
    var s = r.strategies.filter(function (x) { return x.slug === slug; })[0] || r.strategies[0];
    state.strategy = s.slug;
    var o = s.options.filter(function (x) { return x.target === target; })[0] || s.options[0];
    state.target = o.target;
    var sel = pickSelection(o, wanted);
    state.notice = sel ? "" : "unknownLink";
    state.sel = sel || copy(o.initial);
  }

  function readHash() {
    var p = new URLSearchParams(location.hash.slice(1));
    var lang = p.get("lang");
    state.lang = lang && I18N[lang] ? lang : "en";
    var wanted = {};
    p.forEach(function (v, k) { wanted[k] = v; });
    setPlace(p.get("recipe"), p.get("strategy"), p.get("target"), wanted);
  }

  function writeHash() {
    var p = new URLSearchParams();
    p.set("recipe", state.recipe);
    p.set("strategy", state.strategy);
    p.set("target", state.target);
    p.set("lang", state.lang);
    option().axes.forEach(function (a) { p.set(a.axis, state.sel[a.axis]); });
    history.replaceState(null, "", "#" + p.toString());
  }

  function update(change) {
    change();
    writeHash();
    render();
  }

  /* ---------------------------------------------------------------- copy buttons */

  function fallbackCopy(text) {
    var ta = el("textarea", { readonly: true, "aria-hidden": "true", cls: "offscreen" });
    ta.value = text;
    document.body.append(ta);
    ta.select();
    var ok = false;
    try { ok = document.execCommand("copy"); } catch (e) { ok = false; }
    ta.remove();
    return ok;
  }

  function copyButton(getText, what) {
    var button = el("button", { type: "button", cls: "copy", text: t("copy"),
                                "aria-label": t("copyWhat", { what: what }) });
    button.addEventListener("click", function () {
      var done = function () {
        button.textContent = t("copied");
        button.setAttribute("data-copied", "1");
        button.focus();
        setTimeout(function () { button.textContent = t("copy"); }, 1500);
      };
      var text = getText();
      if (navigator.clipboard && window.isSecureContext) {
        navigator.clipboard.writeText(text).then(done, function () {
          if (fallbackCopy(text)) done();
        });
      } else if (fallbackCopy(text)) {
        done();
      }
    });
    return button;
  }

  function codeBlock(text, kind, label, heading) {
    var code = el("code", { "data-block": kind, "data-label": label, text: text });
    return el("div", { cls: "block" },
      el("div", { cls: "block-head" }, el("h4", { text: heading }),
         copyButton(function () { return code.textContent; }, heading)),
      el("pre", { tabindex: "0", "aria-label": heading }, code));
  }

  window.SousPageRender = { el: el, t: t, fragment: fragment, codeBlock: codeBlock,
                            axisTitle: axisTitle, valueLabel: valueLabel, state: state,
                            recipe: recipe, strategy: strategy, option: option,
                            entryOf: entryOf, allowed: allowed, copy: copy,
                            pageText: pageText, update: update, setPlace: setPlace };

  /* ---------------------------------------------------------------- start */

  function render() { window.SousPageViews.render(); }

  function start() {
    if (!DATA || !DATA.recipes || !DATA.recipes.length) {
      var p = byId("no-data");
      p.hidden = false;
      p.textContent = t("noData");
      byId("strategy").hidden = true;
      return;
    }
    readHash();
    writeHash();
    render();
    window.addEventListener("hashchange", function () { readHash(); render(); });
  }

  window.SousPageStart = start;
})();
