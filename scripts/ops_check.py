#!/usr/bin/env python3
"""Checks of the deployment files that no offline tool does for us (called by scripts/ops-check).

  rules --write   generate k8s/monitoring/prometheus-rule.yaml from k8s/monitoring/rules.yaml
  rules --check   fail when prometheus-rule.yaml is not exactly what --write would produce
  manifests       walk every kustomization under k8s/, check that each YAML file there is
                  accounted for, print the Kubernetes objects for kubernetes-validate (one path a
                  line, on stdout), check the Prometheus Operator objects structurally (their
                  CRDs are not in kubernetes-validate's schemas) and the references between
                  objects that `kubectl kustomize` + a cluster would catch (selectors, ports,
                  ConfigMap and Secret names, patch targets)
  dashboard       the Grafana dashboard: JSON, panels with queries and unique ids, and every
                  metric in it and in rules.yaml one of OPERATIONS.md's names
  policies OUT    write each deployable policy directory (base, and base + every overlay's
                  ConfigMap merge) under OUT/<name>/ for `tollgate check`

Needs PyYAML (scripts/ops-check installs it into .venv-ops).
"""
import os
import re
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K8S = os.path.join(ROOT, "k8s")
RULES = os.path.join(K8S, "monitoring", "rules.yaml")
PROM_RULE = os.path.join(K8S, "monitoring", "prometheus-rule.yaml")
# YAML files under k8s/ that are neither kustomizations, resources nor generator inputs.
NOT_OBJECTS = {"monitoring/rules.yaml", "monitoring/rules.test.yaml"}
# Kubernetes objects kept as examples outside any kustomization; still validated.
EXAMPLES = {"base/secret.example.yaml"}
OPERATOR_KINDS = {"PrometheusRule", "ServiceMonitor"}
# OPERATIONS.md's metric names (the contract), plus what Prometheus itself adds.
METRICS = {
    "ai_tokens_total", "ai_requests_failed_total", "ai_requests_total", "ai_cost_usd_total",
    "tollgate_decisions_total", "tollgate_circuit_state", "tollgate_quota_used_ratio",
    "tollgate_budget_used_ratio", "tollgate_reserved_tokens", "tollgate_policy_reloads_total",
    "tollgate_policy_info", "up",
} | {f"{h}{s}" for h in ("ai_request_duration_seconds", "tollgate_overhead_seconds")
     for s in ("_bucket", "_sum", "_count")}
# What the ADR's panel list needs on the dashboard.
DASHBOARD_NEEDS = {
    "ai_tokens_total", "ai_cost_usd_total", "ai_requests_total", "ai_request_duration_seconds_bucket",
    "ai_request_duration_seconds_sum", "ai_requests_failed_total", "tollgate_circuit_state",
    "tollgate_quota_used_ratio", "tollgate_budget_used_ratio", "tollgate_decisions_total",
    "tollgate_overhead_seconds_bucket", "tollgate_reserved_tokens",
}
METRIC_TOKEN = re.compile(r"\b((?:ai|tollgate)_[a-z0-9_]+|up(?=\s*[{\[]))")
DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")

errors = []


def err(msg):
    errors.append(msg)


def rel(path):
    return os.path.relpath(path, K8S)


def load_all(path):
    with open(path, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


# ---------------------------------------------------------------- rules


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper, s):
    style = "|" if "\n" in s else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", s, style=style)


_Dumper.add_representer(str, _str)


def render_prometheus_rule():
    with open(RULES, encoding="utf-8") as f:
        rules = yaml.safe_load(f)
    obj = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "tollgate",
            "labels": {"app.kubernetes.io/name": "tollgate", "role": "alert-rules"},
        },
        "spec": {"groups": rules["groups"]},
    }
    head = (
        "# GENERATED from rules.yaml by `scripts/ops-check --write-rules`: edit rules.yaml,\n"
        "# not this file. scripts/ops-check fails when they differ.\n"
    )
    return head + yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=4096, allow_unicode=True)


def rules(mode):
    want = render_prometheus_rule()
    if mode == "--write":
        with open(PROM_RULE, "w", encoding="utf-8") as f:
            f.write(want)
        print(f"wrote {rel(PROM_RULE)}")
        return
    with open(PROM_RULE, encoding="utf-8") as f:
        have = f.read()
    with open(RULES, encoding="utf-8") as f:
        groups = yaml.safe_load(f)["groups"]
    if yaml.safe_load(have)["spec"]["groups"] != groups:
        err("prometheus-rule.yaml spec.groups differ from rules.yaml: run scripts/ops-check --write-rules")
    elif have != want:
        err("prometheus-rule.yaml is not the generated text: run scripts/ops-check --write-rules")


# ---------------------------------------------------------------- kustomizations


def kustomization(dirpath):
    path = os.path.join(dirpath, "kustomization.yaml")
    with open(path, encoding="utf-8") as f:
        k = yaml.safe_load(f)
    if k.get("kind") != "Kustomization":
        err(f"{rel(path)}: kind is not Kustomization")
    return k


def render(dirpath, seen_files):
    """A small subset of kustomize: resources (files and directories), configMapGenerator
    (files, behavior create/merge), replicas and strategic-merge patches naming a target.
    Returns (objects, configmaps) where configmaps maps generator name -> {key: text}."""
    k = kustomization(dirpath)
    seen_files.add(os.path.join(dirpath, "kustomization.yaml"))
    objects, cms = [], {}
    for r in k.get("resources", []):
        p = os.path.normpath(os.path.join(dirpath, r))
        if os.path.isdir(p):
            o, c = render(p, seen_files)
            objects += o
            for name, data in c.items():
                if name in cms:
                    err(f"{rel(dirpath)}: ConfigMap {name} generated twice")
                cms[name] = data
        elif os.path.isfile(p):
            seen_files.add(p)
            objects += [(p, d) for d in load_all(p)]
        else:
            err(f"{rel(dirpath)}/kustomization.yaml: resource {r} does not exist")
    for g in k.get("configMapGenerator", []):
        data = {}
        for spec in g.get("files", []):
            key, _, src = spec.partition("=") if "=" in spec else (os.path.basename(spec), "", spec)
            p = os.path.join(dirpath, src)
            if not os.path.isfile(p):
                err(f"{rel(dirpath)}/kustomization.yaml: generator file {src} does not exist")
                continue
            seen_files.add(os.path.normpath(p))
            with open(p, encoding="utf-8") as f:
                data[key] = f.read()
        behavior = g.get("behavior", "create")
        name = g["name"]
        if name == "tollgate-policy" and not (g.get("options") or {}).get("disableNameSuffixHash"):
            # A hashed name rolls the pods on every edit instead of a hot reload, and a new pod's
            # emptyDir starts empty: the day's SQLite counters would be lost.
            err(f"{rel(dirpath)}: the tollgate-policy generator needs options.disableNameSuffixHash: true")
        if behavior == "create":
            if name in cms:
                err(f"{rel(dirpath)}: ConfigMap {name} created twice")
            cms[name] = data
        elif behavior in ("merge", "replace"):
            if name not in cms:
                err(f"{rel(dirpath)}: generator {name} has behavior {behavior} but no base creates it")
                continue
            cms[name] = {**cms[name], **data} if behavior == "merge" else data
        else:
            err(f"{rel(dirpath)}: generator {name}: unknown behavior {behavior}")
    for rep in k.get("replicas", []):
        hits = [d for _, d in objects if d.get("kind") == "Deployment" and d["metadata"]["name"] == rep["name"]]
        if not hits:
            err(f"{rel(dirpath)}: replicas names Deployment {rep['name']}, which is not in its resources")
        for d in hits:
            d["spec"]["replicas"] = rep["count"]
    for patch in k.get("patches", []):
        t = patch.get("target", {})
        hits = [d for _, d in objects
                if d.get("kind") == t.get("kind") and d["metadata"]["name"] == t.get("name")]
        if not hits:
            err(f"{rel(dirpath)}: patch target {t} matches no object")
        if "path" in patch:
            p = os.path.join(dirpath, patch["path"])
            seen_files.add(os.path.normpath(p))
            if not os.path.isfile(p):
                err(f"{rel(dirpath)}: patch file {patch['path']} does not exist")
    return objects, cms


def overlays():
    base = os.path.join(K8S, "overlays")
    return sorted(os.path.join(base, d) for d in os.listdir(base)
                  if os.path.isfile(os.path.join(base, d, "kustomization.yaml")))


# ---------------------------------------------------------------- checks


def check_operator(path, d):
    where = f"{rel(path)}: {d.get('kind')} {d.get('metadata', {}).get('name')}"
    if d.get("apiVersion") != "monitoring.coreos.com/v1":
        err(f"{where}: apiVersion must be monitoring.coreos.com/v1")
    if not d.get("metadata", {}).get("name"):
        err(f"{where}: metadata.name missing")
    spec = d.get("spec")
    if not isinstance(spec, dict):
        err(f"{where}: spec missing")
        return
    if d["kind"] == "ServiceMonitor":
        unknown = set(spec) - {"jobLabel", "selector", "endpoints", "namespaceSelector",
                               "targetLabels", "podTargetLabels", "sampleLimit"}
        if unknown:
            err(f"{where}: unknown spec keys {sorted(unknown)}")
        if not spec.get("selector", {}).get("matchLabels"):
            err(f"{where}: spec.selector.matchLabels missing")
        eps = spec.get("endpoints") or []
        if not eps:
            err(f"{where}: no endpoints")
        for ep in eps:
            if not ep.get("port"):
                err(f"{where}: endpoint without a named port")
            for key in ("interval", "scrapeTimeout"):
                if key in ep and not DURATION.match(str(ep[key])):
                    err(f"{where}: endpoint {key} {ep[key]!r} is not a duration")
    else:
        unknown = set(spec) - {"groups"}
        if unknown:
            err(f"{where}: unknown spec keys {sorted(unknown)}")
        names = set()
        for g in spec.get("groups") or []:
            if not g.get("name") or g["name"] in names:
                err(f"{where}: group name missing or repeated")
            names.add(g.get("name"))
            for r in g.get("rules") or []:
                ident = r.get("alert") or r.get("record")
                if not ident or ("alert" in r) == ("record" in r):
                    err(f"{where}: a rule needs exactly one of alert/record")
                if not isinstance(r.get("expr"), str) or not r["expr"].strip():
                    err(f"{where}: {ident}: expr missing")
                if "for" in r and not DURATION.match(str(r["for"])):
                    err(f"{where}: {ident}: for {r['for']!r} is not a duration")
                for key in ("labels", "annotations"):
                    for k, v in (r.get(key) or {}).items():
                        if not isinstance(v, str):
                            err(f"{where}: {ident}: {key}.{k} must be a string")
                if "alert" in r:
                    ann = r.get("annotations") or {}
                    for must in ("summary", "description", "runbook"):
                        if not ann.get(must):
                            err(f"{where}: {ident}: annotation {must} missing")
                    if (r.get("labels") or {}).get("severity") not in ("info", "warning", "critical"):
                        err(f"{where}: {ident}: severity must be info, warning or critical")


def pod_containers(dep):
    """The containers of a Deployment's pod, native sidecars (init containers) included."""
    pod = dep["spec"]["template"]["spec"]
    return pod["containers"] + pod.get("initContainers", [])


def check_references(name, objects, cms, secret_keys):
    """What a cluster would reject or silently get wrong: selectors that select nothing,
    probes on ports that do not exist, volumes naming ConfigMaps nobody generates."""
    by_kind = {}
    for _, d in objects:
        by_kind.setdefault(d["kind"], []).append(d)
    deps = by_kind.get("Deployment", [])
    for dep in deps:
        pod_labels = dep["spec"]["template"]["metadata"]["labels"]
        sel = dep["spec"]["selector"]["matchLabels"]
        if any(pod_labels.get(k) != v for k, v in sel.items()):
            err(f"{name}: Deployment {dep['metadata']['name']} selector does not match its pod labels")
        pod = dep["spec"]["template"]["spec"]
        for v in pod.get("volumes", []):
            if "configMap" in v and v["configMap"]["name"] not in cms and not any(
                    c["metadata"]["name"] == v["configMap"]["name"] for c in by_kind.get("ConfigMap", [])):
                err(f"{name}: volume {v['name']} names ConfigMap {v['configMap']['name']}, which nothing creates")
        vol_names = {v["name"] for v in pod.get("volumes", [])}
        for c in pod_containers(dep):
            ports = {p.get("name") for p in c.get("ports", [])}
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                port = (c.get(probe) or {}).get("httpGet", {}).get("port")
                if isinstance(port, str) and port not in ports:
                    err(f"{name}: {c['name']} {probe} uses port {port!r}, not declared")
            for m in c.get("volumeMounts", []):
                if m["name"] not in vol_names:
                    err(f"{name}: {c['name']} mounts unknown volume {m['name']}")
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref and ref["key"] not in secret_keys.get(ref["name"], set()):
                    err(f"{name}: {c['name']} env {e['name']} uses {ref['name']}/{ref['key']}, not in the example Secret")
    for svc in by_kind.get("Service", []):
        sel = svc["spec"].get("selector", {})
        matched = [d for d in deps
                   if all(d["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in sel.items())]
        if sel and not matched:
            err(f"{name}: Service {svc['metadata']['name']} selects no pod")
        for p in svc["spec"]["ports"]:
            tp = p.get("targetPort")
            if isinstance(tp, str) and matched and not any(
                    cp.get("name") == tp for d in matched
                    for c in pod_containers(d) for cp in c.get("ports", [])):
                err(f"{name}: Service {svc['metadata']['name']} targetPort {tp} is no container port")
    for sm in by_kind.get("ServiceMonitor", []):
        sel = sm["spec"]["selector"]["matchLabels"]
        svcs = [s for s in by_kind.get("Service", [])
                if all(s["metadata"].get("labels", {}).get(k) == v for k, v in sel.items())]
        if not svcs:
            err(f"{name}: ServiceMonitor {sm['metadata']['name']} selects no Service")
        for ep in sm["spec"]["endpoints"]:
            if svcs and not any(p.get("name") == ep["port"] for s in svcs for p in s["spec"]["ports"]):
                err(f"{name}: ServiceMonitor port {ep['port']} is no Service port")
        job_label = sm["spec"].get("jobLabel")
        if job_label and not all(s["metadata"].get("labels", {}).get(job_label) == "tollgate" for s in svcs):
            err(f"{name}: the alert rules select job=\"tollgate\"; Service label {job_label} must be tollgate")


def check_sidecar(name, objects):
    """tollgate runs as a native sidecar (an init container with restartPolicy Always and a
    startupProbe: listening before the app's first call) and is configured through the
    variables the binary reads (TOLLGATE_LOG, not RUST_LOG)."""
    found = False
    for _, d in objects:
        if d.get("kind") != "Deployment":
            continue
        pod = d["spec"]["template"]["spec"]
        for c in pod["containers"]:
            if c["name"] == "tollgate":
                err(f"{name}: tollgate is an ordinary container: make it a native sidecar (initContainers, restartPolicy: Always)")
        for c in pod.get("initContainers", []):
            if c["name"] != "tollgate":
                continue
            found = True
            if c.get("restartPolicy") != "Always":
                err(f"{name}: the tollgate init container needs restartPolicy: Always (a native sidecar)")
            if not c.get("startupProbe"):
                err(f"{name}: the tollgate sidecar needs a startupProbe (the app starts once it passes)")
            env = {e["name"] for e in c.get("env", [])}
            if "RUST_LOG" in env:
                err(f"{name}: tollgate reads TOLLGATE_LOG, not RUST_LOG")
            if "TOLLGATE_LOG" not in env:
                err(f"{name}: the tollgate sidecar sets no TOLLGATE_LOG")
    if not found:
        err(f"{name}: no tollgate sidecar in any Deployment")


def manifests():
    seen, k8s_objects = set(), {}
    secret_keys = {}
    for ex in EXAMPLES:
        p = os.path.join(K8S, ex)
        seen.add(p)
        k8s_objects[p] = load_all(p)
        for d in k8s_objects[p]:
            if d.get("kind") == "Secret":
                secret_keys[d["metadata"]["name"]] = set(d.get("stringData", {})) | set(d.get("data", {}))
    roots = [os.path.join(K8S, "base"), os.path.join(K8S, "monitoring")] + overlays()
    plain, monitored = [], []
    for root in roots:
        objects, cms = render(root, seen)
        for p, d in objects:
            k8s_objects.setdefault(p, [])
            if d.get("kind") in OPERATOR_KINDS:
                check_operator(p, d)
        if root.startswith(os.path.join(K8S, "overlays")):
            check_references(rel(root), objects, cms, secret_keys)
            check_sidecar(rel(root), objects)
            kinds = {d.get("kind") for _, d in objects} & OPERATOR_KINDS
            if os.path.basename(root) == "monitoring":
                monitored.append(rel(root))
                if kinds != OPERATOR_KINDS:
                    err(f"{rel(root)}: the monitoring overlay lacks {sorted(OPERATOR_KINDS - kinds)}")
            elif kinds:
                # Applied to a cluster without the Prometheus Operator CRDs, these fail.
                err(f"{rel(root)}: renders {sorted(kinds)}: only overlays/monitoring may")
            else:
                plain.append(rel(root))
    if not plain or not monitored:
        err(f"need overlays with and without monitoring kinds; without: {plain}, with: {monitored}")
    print(f"overlays without Prometheus Operator kinds: {', '.join(plain)}; with: {', '.join(monitored)}",
          file=sys.stderr)
    for dirpath, _, files in os.walk(K8S):
        for f in files:
            p = os.path.normpath(os.path.join(dirpath, f))
            if f.endswith((".yaml", ".yml", ".json")) and p not in seen and rel(p) not in NOT_OBJECTS:
                err(f"{rel(p)}: in no kustomization and not a known example: validate it or list it")
    for p in sorted(k8s_objects):
        if not any(d.get("kind") in OPERATOR_KINDS for d in load_all(p)):
            print(p)


def metrics_in(expr, where):
    found = set(METRIC_TOKEN.findall(expr))
    for m in found - METRICS:
        err(f"{where}: metric {m} is not in OPERATIONS.md")
    return found


def dashboard():
    import json
    path = os.path.join(K8S, "monitoring", "grafana-dashboard.json")
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except ValueError as e:
        err(f"{rel(path)}: not JSON: {e}")
        return
    used, ids = set(), set()
    for p in d.get("panels", []):
        if p.get("id") in ids:
            err(f"{rel(path)}: panel id {p.get('id')} repeated")
        ids.add(p.get("id"))
        if p.get("type") == "row":
            continue
        if not p.get("targets"):
            err(f"{rel(path)}: panel {p.get('title')!r} has no query")
        for t in p.get("targets", []):
            used |= metrics_in(t.get("expr", ""), f"{rel(path)}: panel {p.get('title')!r}")
    for m in sorted(DASHBOARD_NEEDS - used):
        err(f"{rel(path)}: no panel shows {m}")
    with open(RULES, encoding="utf-8") as f:
        for g in yaml.safe_load(f)["groups"]:
            for r in g["rules"]:
                if not metrics_in(r["expr"], f"rules.yaml: {r.get('alert')}"):
                    err(f"rules.yaml: {r.get('alert')}: no known metric in its expr")


def policies(out):
    """The policy directory each deployable overlay mounts, written out for `tollgate check`."""
    for root in overlays():
        _, cms = render(root, set())
        files = cms.get("tollgate-policy")
        if not files:
            err(f"{rel(root)}: generates no tollgate-policy ConfigMap")
            continue
        d = os.path.join(out, os.path.basename(root))
        os.makedirs(d, exist_ok=True)
        for key, text in files.items():
            with open(os.path.join(d, key), "w", encoding="utf-8") as f:
                f.write(text)
        print(d)


def main(argv):
    if len(argv) == 2 and argv[0] == "rules" and argv[1] in ("--check", "--write"):
        rules(argv[1])
    elif argv == ["dashboard"]:
        dashboard()
    elif argv == ["manifests"]:
        manifests()
    elif len(argv) == 2 and argv[0] == "policies":
        policies(argv[1])
    else:
        sys.exit(__doc__)
    for e in errors:
        print(f"ops_check: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
