{{/* Names, labels and the pieces every workload shares. */}}

{{- define "kvroute.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Resource name prefix, at most 45 characters: "<prefix>-worker" stays within the 52 that a
StatefulSet name may have (its pods' controller-revision-hash label adds 11 to it).
*/}}
{{- define "kvroute.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvroute.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of one component: call with (dict "ctx" $ "component" "router"). */}}
{{- define "kvroute.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvroute.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* All labels of one component: call with (dict "ctx" $ "component" "router"). */}}
{{- define "kvroute.labels" -}}
helm.sh/chart: {{ include "kvroute.chart" .ctx }}
{{ include "kvroute.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: kvroute
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "kvroute.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvroute.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* image: call with (dict "ctx" $ "image" .Values.image). */}}
{{- define "kvroute.image" -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) }}
{{- end }}

{{- define "kvroute.natsName" -}}
{{- printf "%s-nats" (include "kvroute.fullname" .) }}
{{- end }}

{{/* The NATS URL router and workers connect to. */}}
{{- define "kvroute.natsUrl" -}}
{{- if eq .Values.nats.mode "external" }}
{{- required "nats.external.url is required when nats.mode is external" .Values.nats.external.url }}
{{- else }}
{{- printf "nats://%s:4222" (include "kvroute.natsName" .) }}
{{- end }}
{{- end }}

{{/*
Pod settings every kvroute pod shares. No Kubernetes API access, and no service links: a
Service named "kvroute" in the namespace would otherwise inject KVROUTE_PORT=tcp://…, which
both binaries read as their --port.
*/}}
{{- define "kvroute.podCommon" -}}
serviceAccountName: {{ include "kvroute.serviceAccountName" . }}
automountServiceAccountToken: false
enableServiceLinks: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end }}

{{/* A number as a TOML float ("8" becomes "8.0"): the config's float keys. */}}
{{- define "kvroute.tomlFloat" -}}
{{- $s := toString (float64 .) }}
{{- if regexMatch "^-?[0-9]+$" $s }}{{ $s }}.0{{ else }}{{ $s }}{{ end }}
{{- end }}

{{/* The router's TOML config (`kvroute serve --config`): keys are the flags in snake_case. */}}
{{- define "kvroute.routerConfig" -}}
{{- $r := .Values.router -}}
# kvroute serve --config: rendered by the kvroute chart.
nats = {{ include "kvroute.natsUrl" . | toJson }}
host = "0.0.0.0"
port = 8080
cluster = {{ .Values.cluster | toJson }}
policy = {{ $r.policy | toJson }}
{{- if not (kindIs "invalid" $r.prefillScale) }}
prefill_scale = {{ include "kvroute.tomlFloat" $r.prefillScale }}
{{- end }}
{{- if not (kindIs "invalid" $r.decodeWeight) }}
decode_weight = {{ include "kvroute.tomlFloat" $r.decodeWeight }}
{{- end }}
{{- if not (kindIs "invalid" $r.temperature) }}
temperature = {{ include "kvroute.tomlFloat" $r.temperature }}
{{- end }}
lease_ttl_ms = {{ $r.leaseTtlMs | int64 }}
max_inflight = {{ $r.maxInflight | int64 }}
{{- range $key, $value := dict "max_body_bytes" $r.maxBodyBytes "retries" $r.retries "worker_timeout_ms" $r.workerTimeoutMs }}
{{- if not (kindIs "invalid" $value) }}
{{ $key }} = {{ $value | int64 }}
{{- end }}
{{- end }}
drain_timeout_ms = {{ $r.drainTimeoutMs | int64 }}
{{- with $r.tokenizer }}
tokenizer = {{ . | toJson }}
{{- end }}
{{- end }}

{{/* The bundled NATS server's config (nats.conf); $SERVER_NAME comes from the pod name. */}}
{{- define "kvroute.natsConfig" -}}
{{- $n := .Values.nats.bundled -}}
{{- $name := include "kvroute.natsName" . -}}
server_name: $SERVER_NAME
port: 4222
http_port: 8222
pid_file: "/var/run/nats/nats.pid"
lame_duck_duration: "{{ $n.lameDuckSeconds | int64 }}s"
lame_duck_grace_period: "10s"
jetstream {
  store_dir: "/data"
  max_memory_store: {{ $n.jetstream.maxMemoryStore }}
  max_file_store: {{ $n.jetstream.maxFileStore }}
}
{{- if gt (int64 $n.replicas) 1 }}
cluster {
  name: {{ $name | quote }}
  port: 6222
  routes: [
    {{- range $i := until (int $n.replicas) }}
    "nats://{{ $name }}-{{ $i }}.{{ $name }}-headless.{{ $.Release.Namespace }}.svc.{{ $n.clusterDomain }}:6222"
    {{- end }}
  ]
}
{{- end }}
{{- end }}
