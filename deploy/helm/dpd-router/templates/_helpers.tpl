{{/*
Names. Component names stay within 52 characters so that StatefulSet pod names and their
controller-revision-hash labels fit Kubernetes' 63-character limit.
*/}}
{{- define "dpd-router.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "dpd-router.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 44 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 44 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 44 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The name of one component's objects: router, prefill or decode. Call with (list $ "prefill"). */}}
{{- define "dpd-router.componentName" -}}
{{- $root := index . 0 -}}
{{- printf "%s-%s" (include "dpd-router.fullname" $root) (index . 1) | trunc 52 | trimSuffix "-" }}
{{- end }}

{{- define "dpd-router.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "dpd-router.labels" -}}
helm.sh/chart: {{ include "dpd-router.chart" . }}
app.kubernetes.io/name: {{ include "dpd-router.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: dpd-router
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of one component. Call with (list $ "router"). */}}
{{- define "dpd-router.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "dpd-router.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "dpd-router.componentLabels" -}}
{{- $root := index . 0 -}}
{{ include "dpd-router.labels" $root }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "dpd-router.routerImage" -}}
{{- $image := .Values.router.image }}
{{- printf "%s:%s" $image.repository (default .Chart.AppVersion $image.tag) }}
{{- end }}

{{/* "true" when the router reads the Kubernetes API (discovery, or RBAC asked for): its token is mounted. */}}
{{- define "dpd-router.watchesPods" -}}
{{- if or .Values.router.rbac.create .Values.discovery.enabled }}true{{ else }}false{{ end }}
{{- end }}

{{- define "dpd-router.serviceAccountName" -}}
{{- if .Values.router.serviceAccount.create }}
{{- default (include "dpd-router.componentName" (list . "router")) .Values.router.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.router.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The port the router listens on: its own in standalone mode, beside the decoder's in sidecar mode. */}}
{{- define "dpd-router.routerPort" -}}
{{- if eq .Values.router.mode "sidecar" }}{{ .Values.router.sidecarPort }}{{ else }}{{ .Values.router.port }}{{ end }}
{{- end }}

{{/*
The engine pools of every model, as a JSON list: for model and then each of extraModels, its prefill and
decode pool, each {role, component (the objects' name suffix: "prefill", or "<key>-prefill" for an extra
model), model {key, name, source, maxModelLen}, pool (the pool's values; an extra model's own on top of
prefill/decode), several (whether pods carry the model label: with extra models)}.
*/}}
{{- define "dpd-router.enginePools" -}}
{{- $several := gt (len .Values.extraModels) 0 }}
{{- $pools := list }}
{{- $main := dict "key" .Values.model.key "name" .Values.model.name "source" .Values.model.source "maxModelLen" .Values.model.maxModelLen }}
{{- range $role := list "prefill" "decode" }}
{{- $pools = append $pools (dict "role" $role "component" $role "model" $main "pool" (index $.Values $role) "several" $several) }}
{{- end }}
{{- $keys := list .Values.model.key }}
{{- range $extra := .Values.extraModels }}
{{- if has $extra.key $keys }}
{{- fail (printf "extraModels: %q is taken: each model needs a key of its own (model.key is %q)" $extra.key $.Values.model.key) }}
{{- end }}
{{- $keys = append $keys $extra.key }}
{{- $m := dict "key" $extra.key "name" $extra.name "source" ($extra.source | default $extra.name) "maxModelLen" ($extra.maxModelLen | default $.Values.model.maxModelLen) }}
{{- range $role := list "prefill" "decode" }}
{{- $pool := mergeOverwrite (deepCopy (index $.Values $role)) (deepCopy ((index $extra $role) | default dict)) }}
{{- $component := printf "%s-%s" $extra.key $role }}
{{- if gt (len (printf "%s-%s" (include "dpd-router.fullname" $) $component)) 52 }}
{{- fail (printf "extraModels: %s's objects would be named past 52 characters; use a shorter key or release name" $extra.key) }}
{{- end }}
{{- $pools = append $pools (dict "role" $role "component" $component "model" $m "pool" $pool "several" true) }}
{{- end }}
{{- end }}
{{- toJson $pools }}
{{- end }}

{{/*
How many engine pods of a pool the router is told about: its replicas, or with autoscaling on, its
maxReplicas (pods not yet scaled up fail their health probes and get no traffic until they exist).
Call with a pool's values.
*/}}
{{- define "dpd-router.poolSize" -}}
{{- if .autoscaling.enabled }}{{ .autoscaling.maxReplicas }}{{ else }}{{ .replicas }}{{ end }}
{{- end }}

{{/*
The engines of a pool as URLs: each StatefulSet pod by its stable DNS name under the pool's headless
Service. Call with (list $ spec), spec one of enginePools; renders a JSON list.
*/}}
{{- define "dpd-router.engineUrls" -}}
{{- $root := index . 0 -}}
{{- $spec := index . 1 }}
{{- $urls := list }}
{{- if $spec.pool.enabled }}
{{- $name := include "dpd-router.componentName" (list $root $spec.component) }}
{{- range $i := until (int (include "dpd-router.poolSize" $spec.pool)) }}
{{- $urls = append $urls (printf "http://%s-%d.%s.%s.svc.%s:%d" $name $i $name $root.Release.Namespace $root.Values.clusterDomain (int $root.Values.engines.port)) }}
{{- end }}
{{- end }}
{{- toJson $urls }}
{{- end }}

{{/*
The router's settings file (router.yaml): what the chart knows (listen address, model, engines,
tokenizer), then router.settings on top. Every key is a dpd-router setting.
*/}}
{{- define "dpd-router.routerSettings" -}}
{{- $settings := dict "host" "0.0.0.0" "port" (int (include "dpd-router.routerPort" .)) "model" .Values.model.name }}
{{- $_ := set $settings "workers" (include "dpd-router.routerWorkers" . | int) }}
{{- $pools := include "dpd-router.enginePools" . | fromJsonArray }}
{{- $release := printf "app.kubernetes.io/name=%s,app.kubernetes.io/instance=%s" (include "dpd-router.name" .) .Release.Name }}
{{- if .Values.discovery.enabled }}
{{- /* The router watches this release's engine pods; a sidecar keeps its own decoder as decode_urls. */}}
{{- $_ := set $settings "discovery" "kubernetes" }}
{{- $_ := set $settings "kubernetes_namespace" .Release.Namespace }}
{{- $_ := set $settings "kubernetes_role_label" .Values.discovery.roleLabel }}
{{- $_ := set $settings "kubernetes_selector" $release }}
{{- $_ := set $settings "kubernetes_port" (int .Values.engines.port) }}
{{- $_ := set $settings "drain_timeout" (int .Values.engines.terminationGracePeriodSeconds) }}
{{- end }}
{{- if .Values.extraModels }}
{{- if eq .Values.router.mode "sidecar" }}
{{- fail "extraModels: a sidecar router serves its own decoder's one model; use router.mode standalone" }}
{{- end }}
{{- /* Several models: each an entry of `models`, with its own engines (or its own pods' label) and settings. */}}
{{- $models := dict }}
{{- range $spec := $pools }}
{{- $entry := get $models $spec.model.name | default dict }}
{{- if $.Values.discovery.enabled }}
{{- $_ := set $entry "kubernetes_selector" (printf "%s,%s=%s" $release $.Values.discovery.modelLabel $spec.model.key) }}
{{- else }}
{{- $_ := set $entry (printf "%s_urls" $spec.role) (include "dpd-router.engineUrls" (list $ $spec) | fromJsonArray) }}
{{- end }}
{{- $_ := set $models $spec.model.name $entry }}
{{- end }}
{{- range $extra := .Values.extraModels }}
{{- $_ := mergeOverwrite (get $models $extra.name) (deepCopy ($extra.settings | default dict)) }}
{{- end }}
{{- $_ := set $settings "models" $models }}
{{- else if not .Values.discovery.enabled }}
{{- range $spec := $pools }}
{{- $_ := set $settings (printf "%s_urls" $spec.role) (include "dpd-router.engineUrls" (list $ $spec) | fromJsonArray) }}
{{- end }}
{{- end }}
{{- if eq .Values.router.mode "sidecar" }}
{{- $_ := set $settings "decode_urls" (list (printf "http://127.0.0.1:%d" (int .Values.engines.port))) }}
{{- end }}
{{- if .Values.router.tokenizerSubPath }}
{{- $_ := set $settings "tokenizer" (printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) .Values.router.tokenizerSubPath) }}
{{- end }}
{{- with .Values.router.limitsStore.url }}
{{- $_ := set $settings "limits_store" . }}
{{- end }}
{{- $_ := set $settings "responses_store" (.Values.router.responsesStore.url | default "/var/lib/dpd-router/responses.sqlite3") }}
{{- toYaml (mergeOverwrite $settings (deepCopy .Values.router.settings)) }}
{{- end }}

{{/*
Router processes in a router container (the `workers` setting): one a whole core of its CPU request
(router.resources.requests.cpu, "2" or "2500m"), at least one. router.settings.workers wins.
*/}}
{{- define "dpd-router.routerWorkers" -}}
{{- $cpu := toString (dig "requests" "cpu" "1" .Values.router.resources) -}}
{{- if hasSuffix "m" $cpu -}}
{{- max 1 (div (trimSuffix "m" $cpu | int) 1000) -}}
{{- else -}}
{{- max 1 (floor $cpu | int) -}}
{{- end -}}
{{- end }}

{{/* The JSON given to `vllm serve --kv-transfer-config`. */}}
{{- define "dpd-router.kvTransferConfig" -}}
{{- $nixl := dict "kv_connector" "NixlConnector" "kv_role" "kv_both" }}
{{- with .Values.engines.nixl.extraConfig }}
{{- $_ := set $nixl "kv_connector_extra_config" . }}
{{- end }}
{{- if eq .Values.engines.kvConnector "lmcache" }}
{{- $lmcache := dict "kv_connector" "LMCacheConnectorV1" "kv_role" "kv_both" }}
{{- toJson (dict "kv_connector" "MultiConnector" "kv_role" "kv_both" "kv_connector_extra_config" (dict "connectors" (list $nixl $lmcache))) }}
{{- else }}
{{- toJson $nixl }}
{{- end }}
{{- end }}

{{/* Pod anti-affinity spreading a component's pods over nodes. Call with (list $ "router" "soft"). */}}
{{- define "dpd-router.antiAffinity" -}}
{{- $root := index . 0 -}}
{{- $component := index . 1 }}
{{- $mode := index . 2 -}}
{{- if eq $mode "hard" -}}
podAntiAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    - topologyKey: kubernetes.io/hostname
      labelSelector:
        matchLabels:
          {{- include "dpd-router.selectorLabels" (list $root $component) | nindent 10 }}
{{- else if eq $mode "soft" -}}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "dpd-router.selectorLabels" (list $root $component) | nindent 12 }}
{{- end }}
{{- end }}

{{/* The router container, used by the router Deployment and, in sidecar mode, by every decode pod. */}}
{{- define "dpd-router.routerContainer" -}}
- name: router
  image: {{ include "dpd-router.routerImage" . }}
  imagePullPolicy: {{ .Values.router.image.pullPolicy }}
  env:
    - name: DPD_CONFIG
      value: /etc/dpd-router/router.yaml
    {{- with .Values.router.limitsStore.secretKeyRef }}
    - name: DPD_LIMITS_STORE
      valueFrom:
        secretKeyRef:
          name: {{ .name }}
          key: {{ .key }}
    {{- end }}
    {{- with .Values.router.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: {{ if eq .Values.router.mode "sidecar" }}router{{ else }}http{{ end }}
      containerPort: {{ include "dpd-router.routerPort" . }}
      protocol: TCP
  readinessProbe:
    httpGet:
      path: /ready
      port: {{ include "dpd-router.routerPort" . }}
    {{- toYaml .Values.router.readinessProbe | nindent 4 }}
  livenessProbe:
    httpGet:
      path: /health
      port: {{ include "dpd-router.routerPort" . }}
    {{- toYaml .Values.router.livenessProbe | nindent 4 }}
  resources:
    {{- toYaml .Values.router.resources | nindent 4 }}
  securityContext:
    {{- toYaml .Values.router.securityContext | nindent 4 }}
  volumeMounts:
    - name: router-config
      mountPath: /etc/dpd-router
      readOnly: true
    - name: router-tmp
      mountPath: /tmp
    - name: router-state
      mountPath: /var/lib/dpd-router
    {{- if .Values.router.tokenizerSubPath }}
    - name: models
      mountPath: {{ .Values.model.mountPath }}
      readOnly: true
    {{- end }}
    {{- with .Values.router.extraVolumeMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{/* The router's volumes: its settings file, a scratch /tmp (the root filesystem is read-only) and the
Responses store's directory. */}}
{{- define "dpd-router.routerVolumes" -}}
- name: router-config
  configMap:
    name: {{ include "dpd-router.componentName" (list . "router") }}
- name: router-tmp
  emptyDir:
    sizeLimit: 256Mi
- name: router-state
  {{- with .Values.router.responsesStore.volume }}
  {{- toYaml . | nindent 2 }}
  {{- else }}
  emptyDir:
    sizeLimit: 2Gi
  {{- end }}
{{- with .Values.router.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The model volume's source: model.volume, or an emptyDir when it is empty. */}}
{{- define "dpd-router.modelVolume" -}}
{{- if .Values.model.volume }}
{{- toYaml .Values.model.volume }}
{{- else -}}
emptyDir: {}
{{- end }}
{{- end }}
