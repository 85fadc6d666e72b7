/* The recipe page's views: each section is rebuilt from the state on every change (page.js
   owns the state, the URL and the lookups). Controls keep stable ids, so focus is restored
   after a rebuild and keyboard use is not interrupted. */
(function () {
  "use strict";
  var P = window.SousPageRender;
  var el = P.el, t = P.t;
  var byId = function (id) { return document.getElementById(id); };

  function fill(id) {
    var node = byId(id);
    node.replaceChildren.apply(node, Array.prototype.slice.call(arguments, 1).filter(Boolean));
    return node;
  }
  function gib(bytes) { return (bytes / 1073741824).toFixed(1) + " GiB"; }
  function num(n) { return Number(n).toLocaleString("en-US"); }

  /* ---------------------------------------------------------------- top bar, model */

  function renderTopbar() {
    var data = window.SOUS_RECIPE_DATA;
    byId("recipe-picker").hidden = data.recipes.length < 2;
    byId("recipe-picker-label").textContent = t("recipe");
    var select = byId("recipe-select");
    select.replaceChildren.apply(select, data.recipes.map(function (r) {
      return el("option", { value: r.id, text: r.name, selected: r.id === P.state.recipe });
    }));
    select.onchange = function () {
      P.update(function () { P.setPlace(select.value, null, null, null); });
    };
    byId("lang-label").textContent = t("language");
    fill.apply(null, ["lang-switch", byId("lang-label")].concat(
      Object.keys(window.SOUS_I18N).map(function (lang) {
        return el("button", { type: "button", id: "lang-" + lang, lang: lang, "data-lang": lang,
                              "aria-pressed": String(lang === P.state.lang),
                              text: window.SOUS_I18N[lang].langName,
                              on: { click: function () {
                                P.update(function () { P.state.lang = lang; });
                              } } });
      })));
  }

  function renderModel() {
    var r = P.recipe(), copy = P.pageText();
    var badges = el("ul", { cls: "badges", "aria-label": "badges" });
    r.badges.forEach(function (b) { badges.append(el("li", { cls: b.hl ? "hl" : null, text: b.text })); });
    var facts = el("dl", { cls: "facts" });
    var add = function (term, value) {
      if (value) facts.append(el("div", {}, el("dt", { text: term }), el("dd", {}, value)));
    };
    add(t("provider"), r.provider);
    add(t("context"), r.context ? t("tokens", { n: num(r.context) }) : null);
    add(t("variant"), r.variant);
    if (r.hf && /^https?:\/\//.test(r.hf)) {
      add(t("huggingFace"), el("a", { href: r.hf, rel: "noopener noreferrer", target: "_blank",
                                      text: r.model }));
    }
    fill("model",
      el("h1", { id: "model-name", text: r.name }),
      el("p", { cls: "model-id", text: r.model }),
      badges,
      copy.sub ? el("p", { cls: "sub" }, P.fragment(copy.sub)) : null,
      copy.tag ? el("p", { cls: "muted" }, P.fragment(copy.tag)) : null,
      facts);
    document.title = r.name + " · " + t("pageTitle");
    document.documentElement.lang = P.state.lang;
  }

  /* ---------------------------------------------------------------- strategy, target */

  function onTabKey(event) {
    var tabs = Array.prototype.slice.call(document.querySelectorAll("#strategy-tabs [role=tab]"));
    var i = tabs.indexOf(event.currentTarget);
    var next = { ArrowRight: i + 1, ArrowDown: i + 1, ArrowLeft: i - 1, ArrowUp: i - 1,
                 Home: 0, End: tabs.length - 1 }[event.key];
    if (next === undefined) return;
    event.preventDefault();
    var tab = tabs[(next + tabs.length) % tabs.length];
    tab.focus();
    tab.click();
  }

  function renderStrategy() {
    var r = P.recipe(), s = P.strategy(), o = P.option(), copy = P.pageText();
    byId("strategy-title").textContent = t("strategies");
    fill.apply(null, ["strategy-tabs"].concat(r.strategies.map(function (x) {
      var selected = x.slug === s.slug;
      return el("button", {
        type: "button", role: "tab", id: "tab-" + x.slug, "data-slug": x.slug,
        "aria-selected": String(selected), "aria-controls": "strategy-panel",
        tabindex: selected ? "0" : "-1",
        on: { click: function () {
          P.update(function () { P.setPlace(r.id, x.slug, P.state.target, P.state.sel); });
        }, keydown: onTabKey } },
        el("span", { cls: "tab-label", text: x.label }),
        x.tag ? el("span", { cls: "tab-tag", text: x.tag }) : null);
    })));
    byId("strategy-panel").setAttribute("aria-labelledby", "tab-" + s.slug);
    var facts = [s.tag, s.nodes ? t("nodes", { n: s.nodes }) : null, s.variant].filter(Boolean);
    fill("strategy-notes",
      el("p", { cls: "strategy-facts", text: facts.join(" · ") }),
      o.note ? el("p", { cls: "note" }, P.fragment(o.note)) : null,
      copy.strategyNote ? el("p", { cls: "note" }, P.fragment(copy.strategyNote)) : null);
    renderTarget(s, o);
    var hw = [t("hardware", { npus: o.npus || "?", skus: o.skus.join(", ") || "?" })];
    if (o.verified) hw.push(t("verified", { date: o.verified }));
    if (o.modelImpl) hw.push(t("modelImpl", { impl: o.modelImpl }));
    byId("hardware").textContent = hw.join(" · ");
  }

  function renderTarget(s, o) {
    if (s.options.length < 2) {
      fill("target-choice", el("p", { cls: "target-one" },
        el("span", { cls: "legend", text: t("target") + ": " }),
        el("span", { id: "target-only", "data-target": o.target, text: t(o.target) })));
      return;
    }
    var fs = el("fieldset", { cls: "segmented", id: "target-group" },
                el("legend", { text: t("target") }));
    s.options.forEach(function (x) {
      fs.append(radio("target", x.target, t(x.target), x.target === o.target, null, function () {
        P.update(function () {
          P.setPlace(P.state.recipe, s.slug, x.target, P.state.sel);
        });
      }));
    });
    fill("target-choice", fs);
  }

  /* ---------------------------------------------------------------- options */

  function radio(group, value, label, checked, reason, onPick) {
    var id = "opt-" + group + "-" + value;
    var input = el("input", { type: "radio", name: "opt-" + group, id: id, value: value,
                              checked: checked, disabled: !!reason,
                              "aria-describedby": reason ? id + "-why" : null,
                              on: { change: onPick } });
    return el("label", { "for": id, cls: reason ? "seg disabled" : "seg", title: reason,
                         "data-axis": group, "data-value": value },
      input, el("span", { cls: "seg-text", text: label }),
      reason ? el("span", { cls: "why", id: id + "-why", text: reason }) : null);
  }

  /* Why choosing `value` for `axis` (the rest as selected) is refused; null when it is not. */
  function refusal(o, axis, value) {
    var cand = P.copy(P.state.sel);
    cand[axis] = value;
    if (P.allowed(o, cand)) return null;
    var e = P.entryOf(o, cand);
    if (e === undefined) return t("excludedAlways");
    var others = Object.keys(o.excluded[e.x]).filter(function (a) { return a !== axis; });
    if (!others.length) return t("excludedAlways");
    return t("excludedReason", { what: others.map(function (a) {
      return P.axisTitle(a) + ": " + P.valueLabel(a, o.excluded[e.x][a]);
    }).join(", ") });
  }

  function pick(axis, value) {
    P.update(function () { P.state.sel[axis] = value; P.state.notice = ""; });
  }

  function switchControl(o, a) {
    var on = a.values.indexOf("on") >= 0 ? "on" : a.values[1];
    var offValue = a.values[0] === on ? a.values[1] : a.values[0];
    var checked = P.state.sel[a.axis] === on;
    var flip = checked ? offValue : on;
    var reason = refusal(o, a.axis, flip);
    var id = "opt-" + a.axis;
    var input = el("input", { type: "checkbox", role: "switch", id: id, checked: checked,
                              disabled: !!reason, "aria-describedby": reason ? id + "-why" : null,
                              on: { change: function () { pick(a.axis, flip); } } });
    return el("div", { cls: "axis switch-axis" },
      el("label", { "for": id, cls: reason ? "switch disabled" : "switch", title: reason,
                    "data-axis": a.axis },
        input, el("span", { cls: "track", "aria-hidden": "true" }),
        el("span", { cls: "switch-text", text: P.axisTitle(a.axis) }),
        el("span", { cls: "state", "aria-hidden": "true",
                     text: P.valueLabel(a.axis, P.state.sel[a.axis]) })),
      reason ? el("span", { cls: "why", id: id + "-why", text: reason }) : null);
  }

  function radioGroup(o, a) {
    var fs = el("fieldset", { cls: "axis segmented", id: "axis-" + a.axis },
                el("legend", { text: P.axisTitle(a.axis) }));
    a.values.forEach(function (v) {
      var current = P.state.sel[a.axis] === v;
      fs.append(radio(a.axis, v, P.valueLabel(a.axis, v), current,
                      current ? null : refusal(o, a.axis, v),
                      function () { pick(a.axis, v); }));
    });
    return fs;
  }

  function same(a, b) { return JSON.stringify(a) === JSON.stringify(b); }

  function renderOptions() {
    var o = P.option();
    byId("options-title").textContent = t("options");
    var btn = byId("recommended-btn");
    btn.textContent = t("recommended");
    btn.disabled = !o.recommended;
    var isRec = !!o.recommended && same(P.state.sel, o.recommended);
    btn.setAttribute("aria-pressed", String(isRec));
    btn.title = !o.recommended ? t("noRecommended") : (isRec ? t("isRecommended")
                                                               : t("recommendedHint"));
    btn.onclick = function () {
      P.update(function () { P.state.sel = P.copy(o.recommended); P.state.notice = ""; });
    };
    fill.apply(null, ["axes", P.state.notice ? el("p", { cls: "notice", role: "status",
                                                         text: t(P.state.notice) }) : null]
      .concat(o.axes.map(function (a) {
        return a.kind === "option" && a.values.length === 2 ? switchControl(o, a)
                                                             : radioGroup(o, a);
      })));
  }

  /* ---------------------------------------------------------------- fit, commands */

  function fitCard(row) {
    var inp = row.inputs, verdicts = {
      fits: t("fits"), "does not fit": t("doesNotFit"),
      partial: t("partial", { n: row.full_length_seqs_that_fit, m: inp.max_num_seqs }) };
    var largest = t("tokens", { n: num(row.max_model_len_that_fits) }) + " " +
      t("forSeqs", { n: inp.max_num_seqs });
    if (row.model_max_position && row.max_model_len_that_fits > row.model_max_position) {
      largest += " (" + t("modelMax", { n: num(row.model_max_position) }) + ")";
    }
    var kv = gib(row.kv_bytes_per_rank) + (row.kv_replication > 1 ? " × " + row.kv_replication : "");
    var items = [[t("kvPerToken"), num(row.kv_bytes_per_token) + " B", "kv-token"],
                 [t("kvPerRank"), kv, "kv-rank"],
                 [t("weightsPerRank"), gib(row.weight_bytes_per_rank), "weights"],
                 [t("roomForKv"), gib(Math.max(row.kv_room_bytes, 0)), "room"],
                 [t("verdict"), verdicts[row.verdict], "verdict"],
                 [t("largestContext"), largest, "largest"]];
    var dl = el("dl", { cls: "fit-figures" });
    items.forEach(function (it) {
      dl.append(el("div", { "data-fit": it[2], cls: it[2] === "verdict" ? "v-" +
                            row.verdict.replace(/ /g, "-") : null },
                   el("dt", { text: it[0] }), el("dd", { text: it[1] })));
    });
    return el("div", { cls: "fit-card", "data-verdict": row.verdict },
      el("h4", { text: row.processes.join(", ") }),
      el("p", { cls: "muted", text: t("layout", {
        weights: inp.weight_format, kv: inp.kv_cache_dtype, block: inp.block_size,
        tp: inp.tensor_parallel_size, pp: inp.pipeline_parallel_size,
        dp: inp.data_parallel_size, device: inp.device,
        util: inp.gpu_memory_utilization.toFixed(2) }) }),
      dl);
  }

  function renderFitAndCommands() {
    var r = P.recipe(), e = P.entryOf(P.option(), P.state.sel);
    var fitTitle = el("h3", { id: "fit-title", text: t("fit") });
    var cmdTitle = el("h3", { id: "commands-title", text: t("commands") });
    if (typeof e !== "number") {
      var msg = e && "e" in e ? r.texts[e.e] : "?";
      fill("fit", fitTitle);
      fill("commands", cmdTitle, el("p", { cls: "error", role: "alert",
                                           text: t("composeError", { msg: msg }) }));
      return;
    }
    var c = r.compositions[e], fit = r.fits[c.fit];
    fill.apply(null, ["fit", fitTitle, el("p", { cls: "muted", text: t("fitIntro") })].concat(
      fit.error ? [el("p", { cls: "error", text: t("fitError", { msg: fit.error }) })]
                : fit.rows.map(fitCard)));
    var blocks = c.processes.map(function (p) {
      return P.codeBlock(r.texts[p.text], "process", p.label, p.label);
    });
    var router = (c.router || []).map(function (s) {
      return P.codeBlock(r.texts[s.text], "router", s.node, t("router") + " · " + s.node);
    });
    var script = c.script.map(function (i) { return r.texts[i]; }).join("");
    var holders = c.placeholders.length ? el("p", { cls: "placeholders", text: t("placeholders",
      { names: c.placeholders.map(function (n) { return "<" + n + ">"; }).join(", ") }) }) : null;
    var whole = el("details", { cls: "script" },
      el("summary", { text: t("wholeScript") }),
      P.codeBlock(script, "script", "script", t("wholeScript")));
    fill.apply(null, ["commands", cmdTitle, el("p", { cls: "muted", text: t("commandsIntro") }),
                      holders].concat(blocks, router, [whole]));
  }

  function renderInstall() {
    var r = P.recipe();
    fill("install", el("h2", { id: "install-title", text: t("install") }),
      r.installLine ? P.codeBlock(r.installLine, "install", "install", t("install")) : null,
      r.client ? P.codeBlock(r.client, "client", "client", t("client")) : null);
    byId("footer").textContent = t("generated");
  }

  function render() {
    var focused = document.activeElement && document.activeElement.id;
    renderTopbar();
    renderModel();
    renderStrategy();
    renderOptions();
    renderFitAndCommands();
    renderInstall();
    if (focused && byId(focused)) byId(focused).focus();
  }

  window.SousPageViews = { render: render };
  window.SousPageStart();
})();
